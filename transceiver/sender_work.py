"""Work a context rank does off its I/O thread: packing staged pieces and hashing for verification.

A mixin of Sender (it uses the sender's pool, entries, worker and send path). Each job runs on the worker
thread; its callback runs back on the I/O thread (`_run_callbacks`), which owns every piece of state, so the
I/O thread keeps answering heartbeats while large copies or hashes run.
"""

from __future__ import annotations

import logging
import time
from ..formatter.mapping import mapping_for
from . import messages as m
from .handshake import context_digests
from .send_state import Entry
from .sessions import Session

log = logging.getLogger("kvbridge.transceiver.sender")

__all__ = ["SenderWork"]


class SenderWork:
    def _stage(self, ident: bytes, e: Entry, s: Session, from_token: int = 0) -> bool:
        """Start packing the reader's piece (tokens [from_token, n)) into an arena slot; False (go direct)
        when the arena is full."""
        from ..formatter.staging import staging_nbytes
        from .staging import pack

        (piece,) = [p for p in mapping_for(self.layout, s.layout).pieces(s.gen_rank) if p.ctx_rank == self.pool.rank]
        addr = self.pool.arena.alloc(staging_nbytes(self.layout, piece, e.num_tokens, from_token))
        if addr is None:
            return False
        e.slots[s.gen_rank] = addr
        e.packing.add(s.gen_rank)
        fut = self._worker.submit(pack, piece, self.pool.rank_pool, e.blocks, e.num_tokens, self.pool.arena, addr,
                                  from_token)
        self._jobs.append((fut, lambda f: self._packed(f, ident, e, s.gen_rank, addr)))
        return True

    def _packed(self, fut, ident: bytes, e: Entry, gen_rank: int, addr: int) -> None:
        e.packing.discard(gen_rank)
        if self._entries.get(e.rid) is not e:  # finished (expired, cancelled) while packing: the slot is ours
            self.pool.arena.free(e.slots.pop(gen_rank, addr))
            return
        try:
            nbytes = fut.result()
        except Exception as ex:  # noqa: BLE001 - a failed pack falls back to the direct path
            log.warning("request %d: packing for generation rank %d failed (%s); reading direct", e.rid, gen_rank, ex)
            self.pool.arena.free(e.slots.pop(gen_rank, addr))
            addr, nbytes = -1, 0
        self._send(ident, m.Blocks(e.rid, e.blocks, e.num_tokens, e.layers_ready, self.config.lease_s, addr,
                                   nbytes).encode())

    def _run_callbacks(self) -> None:
        still = []
        for fut, callback in self._jobs:
            if fut.done():
                callback(fut)
            else:
                still.append((fut, callback))
        self._jobs = still

    def _check_digests(self, e: Entry, s: Session, digests: list) -> tuple[bool, str]:
        """Verification mode: hash this rank's copy of what the reader read and compare with its digests."""
        mine, layers = context_digests(self.pool, s.layout, s.gen_rank, e.blocks, e.num_tokens,
                                       e.read_from.get(s.gen_rank, 0))
        if len(digests) != len(mine) or not all(isinstance(d, bytes) for d in digests):
            return False, f"integrity: {len(digests)} digests sent, {len(mine)} expected"
        bad = [layers[i] for i, (a, b) in enumerate(zip(mine, digests)) if a != b]
        if bad:
            log.error("request %d: generation rank %d holds corrupted KV in layers %s", e.rid, s.gen_rank, bad)
            return False, f"integrity: received KV differs from the context copy in layers {bad}"
        return True, ""

    def _verified(self, fut, ident: bytes, e: Entry, gen_rank: int) -> None:
        try:
            intact, why = fut.result()
        except Exception as ex:  # noqa: BLE001
            intact, why = False, f"integrity: could not hash the context copy ({ex})"
        e.deadline = time.monotonic() + self.config.lease_s
        self._reader_done(ident, e, gen_rank, intact, why, intact, why)
