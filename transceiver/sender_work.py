"""Work a context rank does off its I/O thread: packing staged pieces and hashing for verification.

A staged reader's slot is packed layer range by layer range as the request's layers become ready (layer-major
canonical order: a layer range is one contiguous byte range of the slot), one pack at a time per reader, in
order; the reader is told (Blocks, then LayersReady) only what is packed.

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
from .send_state import Entry, StagedSlot
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
        wake: wakes the I/O thread (any thread): called as each job finishes, so its callback runs at once,
            not at the loop's next timeout.
    """

    def __init__(self, pool: LocalPool, config: TransceiverConfig, worker: Executor,
                 send: Callable[[bytes, bytes], None], wake: Callable[[], None] = lambda: None) -> None:
        self._pool, self._layout, self._config, self._worker, self._send = pool, pool.layout, config, worker, send
        self._wake = wake
        self._nlocal = pool.layout.local_layers(pool.rank)
        self._stage = pool.layout.stage_layers(pool.layout.coords(pool.rank)[1])  # this rank's global layers
        self._jobs: list[tuple[Future, Callable[[Future], None]]] = []

    @property
    def busy(self) -> bool:
        """Jobs submitted whose callback has not run yet."""
        return bool(self._jobs)

    def stage(self, ident: bytes, e: Entry, s: Session, from_token: int = 0) -> bool:
        """Take an arena slot for the reader's piece (tokens [from_token, n)) and pack the layers ready so far;
        Blocks goes out when that pack is done (layers_ready = the layers packed), a LayersReady after each
        later pack (`pack_more`). False (go direct) when the arena is full."""
        from ..formatter.staging import staging_nbytes

        pool = self._pool
        if s.gen_rank in e.slots:  # a Fetch again (the reader lost its session): its old slot goes
            self.release(e, s.gen_rank)
        (piece,) = [p for p in mapping_for(self._layout, s.layout).pieces(s.gen_rank) if p.ctx_rank == pool.rank]
        nbytes = staging_nbytes(self._layout, piece, e.num_tokens, from_token)
        addr = pool.arena.alloc(nbytes)
        if addr is None:
            return False
        e.slots[s.gen_rank] = StagedSlot(piece, addr, nbytes, from_token)
        self._pack_next(e, s.gen_rank)
        return True

    def pack_more(self, e: Entry) -> None:
        """More layers of `e` are ready: pack them for every staged reader whose slot is not being packed."""
        for gen_rank, slot in list(e.slots.items()):
            if not slot.busy:
                self._pack_next(e, gen_rank)

    def release(self, e: Entry, gen_rank: int | None = None) -> None:
        """Give up the staging slot of one reader (or of all): freed now, or by its pack's callback when a pack
        into it still runs (a slot is never freed while a copy into it may run)."""
        for g in [gen_rank] if gen_rank is not None else list(e.slots):
            slot = e.slots.pop(g, None)
            if slot is not None and not slot.busy:
                self._pool.arena.free(slot.addr)

    def _pack_next(self, e: Entry, gen_rank: int) -> None:
        """Pack the layers of the reader's piece that became ready since its last pack (one pack at a time per
        reader, in order, on the worker); with nothing of the piece among them, tell the reader at once."""
        from .staging import layer_range, pack

        slot = e.slots[gen_rank]
        ready = min(e.layers_ready, self._nlocal)
        if e.state.terminal or e.cancel_requested or gen_rank in e.done or (ready <= slot.packed and slot.told):
            return
        lo, hi = max(self._stage.start + slot.packed, slot.piece.layers.start), min(
            self._stage.start + ready, slot.piece.layers.stop)
        if hi <= lo:  # nothing of the piece in the new layers
            self._told(e, gen_rank, slot, ready)
            return
        sub, off, _nb = layer_range(slot.piece, range(lo, hi), self._layout, e.num_tokens, slot.from_token)
        slot.busy = True
        fut = self._worker.submit(pack, sub, self._pool.rank_pool, e.blocks, e.num_tokens, self._pool.arena,
                                  slot.addr + off, slot.from_token)
        self._add(fut, lambda f: self._packed(f, e, gen_rank, slot, ready))

    def _packed(self, fut: Future, e: Entry, gen_rank: int, slot: StagedSlot, ready: int) -> None:
        slot.busy = False
        if e.slots.get(gen_rank) is not slot or e.state.terminal:  # released (finished, Done, replaced) meanwhile
            if e.slots.get(gen_rank) is slot:
                del e.slots[gen_rank]
            self._pool.arena.free(slot.addr)
            return
        try:
            fut.result()
        except Exception as ex:  # noqa: BLE001 - a failed pack: direct if the reader has read nothing staged
            log.warning("request %d: packing for generation rank %d failed (%s)", e.rid, gen_rank, ex)
            ident = e.fetched[gen_rank]
            if slot.told:  # it may be reading packed ranges: the slot stays until its Done; its pull fails
                slot.packed = self._nlocal  # and nothing more is packed into it
                self._send(ident, m.Error(m.ErrorCode.INTERNAL.value, f"context rank {self._pool.rank} could not "
                                          f"pack request {e.rid}'s KV: {ex}", e.rid, "fetch").encode())
                return
            self.release(e, gen_rank)
            self._send(ident, m.Blocks(e.rid, e.blocks, e.num_tokens, e.layers_ready, self._config.lease_s).encode())
            return
        self._told(e, gen_rank, slot, ready)
        if e.layers_ready > slot.packed:
            self._pack_next(e, gen_rank)

    def _told(self, e: Entry, gen_rank: int, slot: StagedSlot, ready: int) -> None:
        """The reader's slot holds every layer of its piece below local layer `ready`: Blocks the first time,
        LayersReady after."""
        slot.packed = ready
        ident = e.fetched[gen_rank]
        e.deadline = max(e.deadline, time.monotonic() + self._config.lease_s)
        if slot.told:
            self._send(ident, m.LayersReady(e.rid, ready).encode())
            return
        slot.told = True
        self._send(ident, m.Blocks(e.rid, e.blocks, e.num_tokens, ready, self._config.lease_s, slot.addr,
                                   slot.nbytes).encode())

    def verify(self, e: Entry, s: Session, digests: list, then: Callable[[bool, str], None]) -> None:
        """Verification mode: hash this rank's copy of what the reader read and compare with its digests off
        the I/O thread; then `then(intact, why)` on the I/O thread, with the entry's lease renewed."""
        fut = self._worker.submit(self._check_digests, e, s, digests)
        self._add(fut, lambda f: self._verified(f, e, then))

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

    def _add(self, fut: Future, callback: Callable[[Future], None]) -> None:
        self._jobs.append((fut, callback))
        fut.add_done_callback(lambda _f: self._wake())  # (runs at once, here, if the job is already done)

    def run_callbacks(self) -> None:
        """I/O thread: run the callback of every job that finished."""
        still = []
        for fut, callback in self._jobs:
            if fut.done():
                callback(fut)
            else:
                still.append((fut, callback))
        self._jobs = still
