"""Work a generation rank does off its I/O thread, and the staged-path decision: two collaborators the
Receiver holds (no mixin), each given the pool and settings it needs and reading nothing of the Receiver.

`PullFinisher` unpacks staged pieces into the request's blocks on the worker thread (the I/O thread keeps
heartbeating meanwhile), each layer range as soon as its read is done (streamed staging), and hashes them for
verification. `StagingPolicy.want_staged` asks for the staged path only when both sides have an arena, the
piece's direct plan is many small fragments (or the arena is host memory: transceiver.staging_memory), and this
rank's arena has room (it takes the slot); `StagingPolicy.hint` says once per rank how to stage when a
large pull was read directly over NIXL in many small fragments. A partial pull (prefix reuse) stages only
the tokens it lacks: both sides pack / unpack tokens [from_token, n). Never frees blocks; the receiver frees
the slots.
"""

from __future__ import annotations

import logging
from concurrent.futures import Executor

from ..agents import XferState
from ..formatter.staging import many_small
from .config import TransceiverConfig
from .ctx_peer import CtxPeer
from .pool import LocalPool
from .pull import Leg, Pull, ReceiveResult

log = logging.getLogger("kvbridge.transceiver.receiver")

HINT_MIN_BYTES = 64 << 20  # below this a pull's descriptors cost too little in all to be worth a warning

__all__ = ["PullFinisher", "StagingPolicy"]


class PullFinisher:
    """Unpacks and hashes pulls (worker thread), and hands it each staged range as soon as its read is done
    (`unpack_ready`, I/O thread), so once the last read settles only its own range remains to unpack.

    Args:
        pool: this generation rank's pool (its arena holds the staged pieces).
        verify: hash every leg (verification mode).
    """

    def __init__(self, pool: LocalPool, verify: bool) -> None:
        self._pool, self._verify = pool, verify

    def needed(self, pull: Pull) -> bool:
        """Whether `finish` has anything to do for this pull (a staged leg, or verification)."""
        return self._verify or any(leg.remote_slot >= 0 for leg in pull.legs.values())

    def unpack_ready(self, pull: Pull, worker: Executor) -> None:
        """I/O thread: submit the unpack of every staged range whose read is done, in order, each once."""
        for leg in pull.legs.values():
            while leg.remote_slot >= 0 and len(leg.unpacks) < len(leg.ranges) and \
                    leg.handles[len(leg.unpacks)].state() is XferState.DONE:
                leg.unpacks.append(worker.submit(self._unpack, pull, leg, leg.ranges[len(leg.unpacks)]))

    def _unpack(self, pull: Pull, leg: Leg, layers: range) -> None:
        from . import staging  # loaded with the arena (LocalPool)

        pool = self._pool
        sub, off, _nb = staging.layer_range(leg.piece, layers, pool.layout, pull.num_tokens, pull.from_token)
        staging.unpack(sub, pool.rank_pool, pull.blocks, pull.num_tokens, pool.arena, leg.slot + off,
                       pull.from_token)

    def finish(self, pull: Pull) -> dict[int, list[bytes]]:
        """Unpack what of every staged leg is not unpacked yet (an unpack that failed raises here), then hash
        (verification mode): {ctx_rank: digests}."""
        for leg in pull.legs.values():
            if leg.remote_slot < 0:
                continue
            for job in leg.unpacks:  # submitted before this job on the one worker thread: finished
                job.result()
            for layers in leg.ranges[len(leg.unpacks):]:
                self._unpack(pull, leg, layers)
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
        self._hinted = False

    def hint(self, result: ReceiveResult) -> None:
        """Once per rank: a pull of at least HINT_MIN_BYTES read over NIXL in many small fragments (the staged
        path's own criterion) was bound by NIXL's cost per descriptor, not by the link: say how to stage."""
        cfg, n = self._config, result.fragments
        if self._hinted or not result.ok or "nixl" not in result.agents or result.nbytes < HINT_MIN_BYTES:
            return
        if not many_small(n, result.nbytes, cfg.staging_threshold_bytes, cfg.staging_min_fragments):
            return
        self._hinted = True
        log.warning("request %d: %d fragments of %d bytes on average were read directly over NIXL, whose "
                    "cost per descriptor bounds such a read (~4.6 us each: 3.2-3.8 GB/s for 16 KiB fragments "
                    "between two H100s). A staging arena on both sides, with room for such a piece "
                    "(transceiver.staging_arena_bytes, docs/staging.md), packs them into one descriptor per "
                    "piece (said once)", result.request_id, n, result.nbytes // n)

    def want_staged(self, pull: Pull, leg: Leg, peer: CtxPeer) -> bool:
        """Ask for the staged path when both sides have an arena, the piece's direct plan is many small
        fragments, and this rank's arena has room for the piece (the slot is taken now, into `leg.slot`)."""
        arena, cfg, pool = self._pool.arena, self._config, self._pool
        if leg.slot is not None:  # a Fetch sent again (the context rank lost our session): keep its slot
            return True
        host = cfg.staging_memory == "host"  # every piece staged: the wire carries host memory only
        if arena is None or not peer.welcome.staging_bytes or not (host or cfg.staging_threshold_bytes):
            return False
        from ..formatter.staging import staging_nbytes
        from .staging import worth_staging  # loaded with the arena (LocalPool), so no import happens here
        if not host and not worth_staging(leg.piece, peer.remote, pool.rank_pool, pull.num_tokens,
                                          cfg.staging_threshold_bytes, cfg.staging_min_fragments):
            return False
        nbytes = staging_nbytes(pool.layout, leg.piece, pull.num_tokens, pull.from_token)
        leg.slot = arena.alloc(nbytes)
        leg.slot_bytes = nbytes if leg.slot is not None else 0
        leg.slot_mem = (arena.kind, arena.device)
        return leg.slot is not None
