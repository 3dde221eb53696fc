"""The staged path in the transceiver: pack on the context side, one read, unpack on the generation side.

When a piece's direct plan is many small fragments (say 4 KiB: one head of one layer of one block), a read is
bound by per-descriptor cost, not bandwidth. Then the generation rank asks for the piece staged: the context
rank packs it into a slot of its staging arena in the canonical order of formatter/staging.py ([layers, kv,
heads, tokens, head_dim], independent of either pool's layout), the generation rank reads the slot as ONE
descriptor into a slot of its own arena and unpacks it into its blocks. Both local copies are vectorised
(agents/staging.py gather/scatter: one index over rows, torch on GPUs, numpy on hosts).

A host arena (transceiver.staging_memory: host) is pinned host memory beside a GPU pool: every piece is staged
so the wire carries host memory only, and the copies go through a bounded device buffer (`through_temp`).
Layers are outermost in the canonical order, so a layer range of a piece is one byte range of its slot
(`layer_range`): a streamed request is packed, read and unpacked range by range (docs/staging.md).

Owns the arena (a registered scratch region per rank, handed out in slots) and the pack/unpack calls. Never
touches sockets; slots are freed by whoever allocated them, on every path (done, failure, expiry, close).
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import torch  # imported with the arena, on the constructing thread: a first import from a worker can deadlock

from ..agents import MemoryKind, MemoryRegion
from ..agents.staging import chunks, gather, scatter, span_view
from ..formatter.mapping import Piece
from ..formatter.planner import RankPool, plan_stats
from ..formatter.staging import layer_range, many_small, plan_pack, plan_unpack, staging_nbytes, staging_pool

__all__ = ["StagingArena", "layer_range", "pack", "through_temp", "unpack", "worth_staging"]

_ALIGN = 256


class StagingArena:
    """A contiguous scratch buffer handed out in slots (first fit, 256-byte aligned).

    Args:
        kind, device: where the pool lives (the copies into and out of slots run there).
        nbytes: the arena's size.
        memory: "device": on the pool's device; "host": pinned host memory for a VRAM pool (numpy for a DRAM
            pool), so reads between ranks move host memory only. `kind`/`device` are the arena's own.
    """

    def __init__(self, kind: MemoryKind, device: int, nbytes: int, memory: str = "device") -> None:
        if memory == "host" and kind is MemoryKind.VRAM:
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        elif kind is MemoryKind.VRAM:
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
        else:
            self.buffer = np.empty(nbytes, dtype=np.uint8)
        self.region = MemoryRegion.of(self.buffer)
        self.kind, self.device = self.region.kind, self.region.device
        self.base, self.nbytes = self.region.addr, nbytes
        self._free = [(0, nbytes)]  # (offset, size), sorted by offset
        self._used: dict[int, int] = {}
        self._lock = threading.Lock()

    def view(self, addr: int, nbytes: int):
        """A uint8 tensor over `nbytes` of the arena at `addr` (a slice of the buffer: pinned stays pinned)."""
        off = addr - self.base
        if not self.contains(addr, nbytes):
            raise ValueError(f"{nbytes} bytes at {addr:#x} are outside the staging arena")
        if isinstance(self.buffer, np.ndarray):
            return torch.from_numpy(self.buffer[off:off + nbytes])
        return self.buffer[off:off + nbytes]

    def alloc(self, nbytes: int) -> int | None:
        """Address of a slot of `nbytes`, or None when the arena has no room (the caller goes direct)."""
        size = -(-int(nbytes) // _ALIGN) * _ALIGN
        with self._lock:
            for i, (off, free) in enumerate(self._free):
                if free >= size:
                    self._free[i:i + 1] = [(off + size, free - size)] if free > size else []
                    self._used[off] = size
                    return self.base + off
        return None

    def free(self, addr: int) -> None:
        with self._lock:
            off = addr - self.base
            size = self._used.pop(off, None)
            if size is None:
                return
            self._free.append((off, size))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for o, s in self._free:
                if merged and merged[-1][0] + merged[-1][1] == o:
                    merged[-1] = (merged[-1][0], merged[-1][1] + s)
                else:
                    merged.append((o, s))
            self._free = merged

    @property
    def in_use(self) -> int:
        with self._lock:
            return sum(self._used.values())

    def contains(self, addr: int, nbytes: int) -> bool:
        return self.base <= addr and addr + nbytes <= self.base + self.nbytes


def worth_staging(piece: Piece, remote: RankPool, local: RankPool, num_tokens: int, threshold_bytes: int,
                  min_fragments: int) -> bool:
    """True when the direct plan would be at least `min_fragments` fragments of mean size < threshold."""
    return many_small(plan_stats(piece, remote, local, num_tokens), staging_nbytes(local.layout, piece, num_tokens),
                      threshold_bytes, min_fragments)


_STREAMS: dict[int, torch.cuda.Stream] = {}


@contextlib.contextmanager
def _side_stream(kind: MemoryKind, device: int):
    """Run a pack's or unpack's device work on a stream of its own (one per device), synchronised on the way
    out, failure included. Apart from the engine's streams, a pack during a prefill waits neither for the
    prefill's queued kernels nor they for it; the KV it reads is final (an executor marks layers ready, or
    publishes, only once their kernels completed: executor/streaming.py, executor/worker.py)."""
    if kind is not MemoryKind.VRAM:
        yield
        return
    stream = _STREAMS.get(device) or _STREAMS.setdefault(device, torch.cuda.Stream(device=device))
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        stream.synchronize()


CHUNK_BYTES = 64 << 20  # device memory a copy between a VRAM pool and a host arena borrows at once


def through_temp(kind: MemoryKind, device: int, addrs: np.ndarray, lengths: np.ndarray, slot, to_slot: bool,
                 chunk_bytes: int = CHUNK_BYTES) -> None:
    """Copy between ranges of a pool (on `kind`/`device`) and a slot elsewhere (a host arena), through one
    temporary buffer of at most `chunk_bytes` on the pool's device: a vectorised gather there, then one copy
    to the slot per chunk (or the reverse). Done on return (each copy to or from the slot waits for its chunk).

    Args:
        kind, device: where the ranges live.
        addrs, lengths: int64 arrays, in the slot's order (their concatenation tiles the slot).
        slot: a contiguous 1-D uint8 tensor of sum(lengths) bytes.
        to_slot: gather into the slot (pack) or scatter out of it (unpack).
    """
    total = int(lengths.sum())
    if total == 0:
        return
    with _side_stream(kind, device):
        temp = torch.empty(min(total, chunk_bytes), dtype=torch.uint8,
                           device=f"cuda:{device}" if kind is MemoryKind.VRAM else "cpu")
        off = 0
        for a, n, nb in chunks(addrs, lengths, chunk_bytes):
            if to_slot:
                gather(kind, device, a, n, temp)
                slot[off:off + nb].copy_(temp[:nb])  # same stream after the gather; blocking: temp is free after
            else:
                temp[:nb].copy_(slot[off:off + nb])  # queued after the previous chunk's scatter on the same stream
                scatter(kind, device, a, n, temp[:nb])
            off += nb


def _copy(pool: RankPool, arena: StagingArena, addrs: np.ndarray, lengths: np.ndarray, addr: int, nbytes: int,
          to_slot: bool) -> None:
    if arena.kind is pool.kind:  # the arena on the pool's device: one vectorised copy straight into the slot
        with _side_stream(pool.kind, pool.device):
            slot = span_view(arena.kind, arena.device, addr, nbytes)
            (gather if to_slot else scatter)(pool.kind, pool.device, addrs, lengths, slot)
    else:
        through_temp(pool.kind, pool.device, addrs, lengths, arena.view(addr, nbytes), to_slot)


def pack(piece: Piece, pool: RankPool, blocks, num_tokens: int, arena: StagingArena, addr: int,
         first_token: int = 0) -> int:
    """Gather `piece` of a request's tokens [first_token, num_tokens) from `pool` into the slot at `addr`;
    returns the slot's bytes (done on return)."""
    nbytes = staging_nbytes(pool.layout, piece, num_tokens, first_token)
    stg = staging_pool(pool.layout, piece, addr, num_tokens, arena.kind, arena.device, first_token)
    f = plan_pack(piece, pool, stg, blocks, num_tokens, first_token)
    order = np.argsort(f.dst, kind="stable")  # staging-side order tiles the slot contiguously
    _copy(pool, arena, f.src[order], f.length[order], addr, nbytes, True)
    return nbytes


def unpack(piece: Piece, pool: RankPool, blocks, num_tokens: int, arena: StagingArena, addr: int,
           first_token: int = 0) -> None:
    """Scatter `piece` (tokens [first_token, num_tokens)) from the slot at `addr` into the request's blocks of
    `pool` (done on return)."""
    nbytes = staging_nbytes(pool.layout, piece, num_tokens, first_token)
    stg = staging_pool(pool.layout, piece, addr, num_tokens, arena.kind, arena.device, first_token)
    f = plan_unpack(piece, stg, pool, blocks, num_tokens, first_token)
    order = np.argsort(f.src, kind="stable")
    _copy(pool, arena, f.dst[order], f.length[order], addr, nbytes, False)

