"""Work a generation rank does off its I/O thread, and the staged-path decision: two collaborators the
Receiver holds (no mixin), each given the pool and settings it needs and reading nothing of the Receiver.

`PullFinisher.finish` runs on the worker thread (the I/O thread keeps heartbeating meanwhile): it unpacks
staged pieces into the request's blocks and hashes them for verification. `StagingPolicy.want_staged` asks for
the staged path only when both sides have an arena, the piece's direct plan is many small fragments, and this
rank's arena has room (it takes the slot). A partial pull (prefix reuse) stages only the tokens it lacks: both
sides pack / unpack tokens [from_token, n). Never frees blocks; the receiver frees the slots.
"""

from __future__ import annotations

from .config import TransceiverConfig
from .ctx_peer import CtxPeer
from .pool import LocalPool
from .pull import Leg, Pull

__all__ = ["PullFinisher", "StagingPolicy"]


class PullFinisher:
    """Unpacks and hashes a pull whose reads settled (worker thread only).

    Args:
        pool: this generation rank's pool (its arena holds the staged pieces).
        verify: hash every leg (verification mode).
    """

    def __init__(self, pool: LocalPool, verify: bool) -> None:
        self._pool, self._verify = pool, verify

    def needed(self, pull: Pull) -> bool:
        """Whether `finish` has anything to do for this pull (a staged leg, or verification)."""
        return self._verify or any(leg.remote_slot >= 0 for leg in pull.legs.values())

    def finish(self, pull: Pull) -> dict[int, list[bytes]]:
        """Unpack every staged leg into the request's blocks, then hash (verification mode): {ctx_rank: digests}."""
        from .staging import unpack  # loaded with the arena (LocalPool)

        pool = self._pool
        for leg in pull.legs.values():
            if leg.remote_slot >= 0:
                unpack(leg.piece, pool.rank_pool, pull.blocks, pull.num_tokens, pool.arena, leg.slot, pull.from_token)
        return {r: self._digests(pull, leg) for r, leg in pull.legs.items()} if self._verify else {}

    def _digests(self, pull: Pull, leg: Leg) -> list[bytes]:
        from ..formatter.digest import piece_digests  # torch + xxhash, only in verification mode

        return piece_digests(self._pool.buffers, self._pool.rank_pool, leg.piece, pull.blocks, pull.num_tokens,
                             pull.from_token)


class StagingPolicy:
    """Decides, per leg, between the staged and the direct path (I/O thread only).

    Args:
        pool: this generation rank's pool (no arena: always direct).
        config: staging_threshold_bytes and staging_min_fragments.
    """

    def __init__(self, pool: LocalPool, config: TransceiverConfig) -> None:
        self._pool, self._config = pool, config

    def want_staged(self, pull: Pull, leg: Leg, peer: CtxPeer) -> bool:
        """Ask for the staged path when both sides have an arena, the piece's direct plan is many small
        fragments, and this rank's arena has room for the piece (the slot is taken now, into `leg.slot`)."""
        arena, cfg, pool = self._pool.arena, self._config, self._pool
        if leg.slot is not None:  # a Fetch sent again (the context rank lost our session): keep its slot
            return True
        if arena is None or not peer.welcome.staging_bytes or not cfg.staging_threshold_bytes:
            return False
        from ..formatter.staging import staging_nbytes
        from .staging import worth_staging  # loaded with the arena (LocalPool), so no import happens here
        if not worth_staging(leg.piece, peer.remote, pool.rank_pool, pull.num_tokens,
                             cfg.staging_threshold_bytes, cfg.staging_min_fragments):
            return False
        nbytes = staging_nbytes(pool.layout, leg.piece, pull.num_tokens, pull.from_token)
        leg.slot = arena.alloc(nbytes)
        leg.slot_bytes = nbytes if leg.slot is not None else 0
        return leg.slot is not None
