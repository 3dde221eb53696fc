"""Work a context rank does off its I/O thread: packing staged pieces and hashing for verification.

`SenderJobs` is a collaborator the Sender holds (no mixin): it is given the pool, the layout, the settings,
the worker executor and a `send(ident, frame)` callable, and reads nothing else of the Sender. Each job runs
on the worker thread; its callback runs back on the I/O thread (`run_callbacks`, called by the Sender's loop),
which owns every piece of state, so the I/O thread keeps answering heartbeats while large copies or hashes
run. Never frees blocks; frees only the staging slots it allocated.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Executor, Future
from typing import Callable

from ..formatter.mapping import mapping_for
from . import messages as m
from .config import TransceiverConfig
from .handshake import context_digests
from .pool import LocalPool
from .send_state import Entry
from .sessions import Session

log = logging.getLogger("kvbridge.transceiver.sender")

__all__ = ["SenderJobs"]


class SenderJobs:
    """Packing and hashing jobs of one Sender, with the callbacks that finish them on the I/O thread.

    Args:
        pool: this context rank's pool (its arena holds the staging slots).
        config: lease_s (renewed when a job finishes).
        worker: where the jobs run (the Sender's one worker thread).
        send: sends one frame to a ROUTER identity (I/O thread only).
    """

    def __init__(self, pool: LocalPool, config: TransceiverConfig, worker: Executor,
                 send: Callable[[bytes, bytes], None]) -> None:
        self._pool, self._layout, self._config, self._worker, self._send = pool, pool.layout, config, worker, send
        self._jobs: list[tuple[Future, Callable[[Future], None]]] = []

    @property
    def busy(self) -> bool:
        """Jobs submitted whose callback has not run yet."""
        return bool(self._jobs)

    def stage(self, ident: bytes, e: Entry, s: Session, from_token: int = 0) -> bool:
        """Start packing the reader's piece (tokens [from_token, n)) into an arena slot; Blocks goes out when
        the pack is done. False (go direct) when the arena is full."""
        from ..formatter.staging import staging_nbytes
        from .staging import pack

        pool = self._pool
        (piece,) = [p for p in mapping_for(self._layout, s.layout).pieces(s.gen_rank) if p.ctx_rank == pool.rank]
        addr = pool.arena.alloc(staging_nbytes(self._layout, piece, e.num_tokens, from_token))
        if addr is None:
            return False
        e.slots[s.gen_rank] = addr
        e.packing.add(s.gen_rank)
        fut = self._worker.submit(pack, piece, pool.rank_pool, e.blocks, e.num_tokens, pool.arena, addr, from_token)
        self._jobs.append((fut, lambda f: self._packed(f, ident, e, s.gen_rank, addr)))
        return True

    def _packed(self, fut: Future, ident: bytes, e: Entry, gen_rank: int, addr: int) -> None:
        e.packing.discard(gen_rank)
        if e.state.terminal:  # finished (expired, cancelled) while packing: the slot is ours to free
            self._pool.arena.free(e.slots.pop(gen_rank, addr))
            return
        try:
            nbytes = fut.result()
        except Exception as ex:  # noqa: BLE001 - a failed pack falls back to the direct path
            log.warning("request %d: packing for generation rank %d failed (%s); reading direct", e.rid, gen_rank, ex)
            self._pool.arena.free(e.slots.pop(gen_rank, addr))
            addr, nbytes = -1, 0
        self._send(ident, m.Blocks(e.rid, e.blocks, e.num_tokens, e.layers_ready, self._config.lease_s, addr,
                                   nbytes).encode())

    def verify(self, e: Entry, s: Session, digests: list, then: Callable[[bool, str], None]) -> None:
        """Verification mode: hash this rank's copy of what the reader read and compare with its digests off
        the I/O thread; then `then(intact, why)` on the I/O thread, with the entry's lease renewed."""
        fut = self._worker.submit(self._check_digests, e, s, digests)
        self._jobs.append((fut, lambda f: self._verified(f, e, then)))

    def _check_digests(self, e: Entry, s: Session, digests: list) -> tuple[bool, str]:
        mine, layers = context_digests(self._pool, s.layout, s.gen_rank, e.blocks, e.num_tokens,
                                       e.read_from.get(s.gen_rank, 0))
        if len(digests) != len(mine) or not all(isinstance(d, bytes) for d in digests):
            return False, f"integrity: {len(digests)} digests sent, {len(mine)} expected"
        bad = [layers[i] for i, (a, b) in enumerate(zip(mine, digests)) if a != b]
        if bad:
            log.error("request %d: generation rank %d holds corrupted KV in layers %s", e.rid, s.gen_rank, bad)
            return False, f"integrity: received KV differs from the context copy in layers {bad}"
        return True, ""

    def _verified(self, fut: Future, e: Entry, then: Callable[[bool, str], None]) -> None:
        try:
            intact, why = fut.result()
        except Exception as ex:  # noqa: BLE001
            intact, why = False, f"integrity: could not hash the context copy ({ex})"
        e.deadline = time.monotonic() + self._config.lease_s
        then(intact, why)

    def run_callbacks(self) -> None:
        """I/O thread: run the callback of every job that finished."""
        still = []
        for fut, callback in self._jobs:
            if fut.done():
                callback(fut)
            else:
                still.append((fut, callback))
        self._jobs = still
