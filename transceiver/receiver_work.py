"""Work a generation rank does off its I/O thread, and the staged-path decision.

A mixin of Receiver. Unpacking staged pieces and hashing for verification run on the worker thread (the I/O
thread keeps heartbeating meanwhile); the staged path is asked for only when both sides have an arena, the
piece's direct plan is many small fragments, and this rank's arena has room. A partial pull (prefix reuse)
stages only the tokens it lacks: both sides pack / unpack tokens [from_token, n).
"""

from __future__ import annotations

from .ctx_peer import CtxPeer
from .pull import Leg, Pull

__all__ = ["ReceiverWork"]


class ReceiverWork:
    def _digests(self, pull: Pull, leg: Leg) -> list[bytes]:
        from ..formatter.digest import piece_digests  # torch + xxhash, only in verification mode

        return piece_digests(self.pool.buffers, self.pool.rank_pool, leg.piece, pull.blocks, pull.num_tokens,
                             pull.from_token)

    def _finish_pull(self, pull: Pull) -> dict[int, list[bytes]]:
        """Worker thread: unpack every staged leg into the request's blocks, then hash (verification mode)."""
        from .staging import unpack  # loaded with the arena (LocalPool)

        for leg in pull.legs.values():
            if leg.remote_slot >= 0:
                unpack(leg.piece, self.pool.rank_pool, pull.blocks, pull.num_tokens, self.pool.arena, leg.slot,
                       pull.from_token)
        return {r: self._digests(pull, leg) for r, leg in pull.legs.items()} if self.config.verify else {}

    def _want_staged(self, pull: Pull, leg: Leg, peer: CtxPeer) -> bool:
        """Ask for the staged path when both sides have an arena, the piece's direct plan is many small
        fragments, and this rank's arena has room for the piece (the slot is taken now)."""
        arena, cfg = self.pool.arena, self.config
        if arena is None or not peer.welcome.staging_bytes or not cfg.staging_threshold_bytes:
            return False
        from ..formatter.staging import staging_nbytes
        from .staging import worth_staging  # loaded with the arena (LocalPool), so no import happens here
        if not worth_staging(leg.piece, peer.remote, self.pool.rank_pool, pull.num_tokens,
                             cfg.staging_threshold_bytes, cfg.staging_min_fragments):
            return False
        nbytes = staging_nbytes(self.layout, leg.piece, pull.num_tokens, pull.from_token)
        leg.slot = arena.alloc(nbytes)
        leg.slot_bytes = nbytes if leg.slot is not None else 0
        return leg.slot is not None
