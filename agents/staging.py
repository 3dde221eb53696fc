"""Vectorised byte-range arithmetic for two-sided connections: coalesce, window, gather, scatter.

Owns the copies between scattered registered memory (a DescriptorList of absolute addresses) and one
contiguous staging tensor, for connections that can only send or receive contiguous buffers. There is no
Python loop per fragment: the ranges become one index tensor over rows of `g` bytes, `g` the largest power
of two dividing every offset and length (KV fragments give g >= 128, so the index is small), and one
`index_select` / `index_copy_` moves them. Host memory is viewed through ctypes, device memory through
`__cuda_array_interface__`; the same torch code serves both, so the gloo path tested on CPU is the NCCL path.

Never keeps a view past the call that made it and never frees memory. Callers have bounds-checked the
ranges (RegionTable) before they get here: these functions trust addresses.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import numpy as np

from .base import MemoryKind

__all__ = ["coalesce", "window", "chunks", "gather", "scatter", "host_view", "span_view"]

MAX_INDEX_ROWS = 1 << 20  # index entries built at once (8 MiB of int64); larger copies go in steps
MAX_ROW_BYTES = 1 << 20   # cap on g, so a single huge fragment still indexes a few rows, not one giant row


def coalesce(addrs: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge ranges that continue exactly where the previous one ends (order kept; stream unchanged)."""
    if addrs.shape[0] <= 1:
        return addrs, lengths
    starts = np.empty(addrs.shape[0], dtype=bool)
    starts[0] = True
    np.not_equal(addrs[1:], addrs[:-1] + lengths[:-1], out=starts[1:])
    idx = np.flatnonzero(starts)
    if idx.shape[0] == addrs.shape[0]:
        return addrs, lengths
    return addrs[idx], np.add.reduceat(lengths, idx)


def window(addrs: np.ndarray, lengths: np.ndarray, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """The pieces covering bytes [start, stop) of the ranges' concatenation, as (addrs, lengths)."""
    ends = np.cumsum(lengths)
    begins = ends - lengths
    i0 = int(np.searchsorted(ends, start, side="right"))
    i1 = int(np.searchsorted(begins, stop, side="left"))
    b, e = begins[i0:i1], ends[i0:i1]
    lo = np.maximum(b, start)
    return addrs[i0:i1] + (lo - b), np.minimum(e, stop) - lo


def chunks(addrs: np.ndarray, lengths: np.ndarray,
           chunk_bytes: int) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """Split the ranges' concatenation into pieces of at most chunk_bytes: yields (addrs, lengths, nbytes)."""
    addrs, lengths = coalesce(addrs, lengths)
    total = int(lengths.sum())
    if total <= chunk_bytes:
        if total:
            yield addrs, lengths, total
        return
    for start in range(0, total, chunk_bytes):
        stop = min(total, start + chunk_bytes)
        a, n = window(addrs, lengths, start, stop)
        yield a, n, stop - start


def host_view(addr: int, nbytes: int):
    """A uint8 CPU tensor over `nbytes` of host memory at `addr` (no copy, no ownership)."""
    import torch

    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(addr), dtype=torch.uint8)


class _CudaSpan:
    """Just enough of `__cuda_array_interface__` for torch.as_tensor to view device memory by address."""

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False),
                                         "version": 3, "strides": None}


def span_view(kind: MemoryKind, device: int, addr: int, nbytes: int):
    """A uint8 tensor over `nbytes` at `addr`: CPU for DRAM, cuda:`device` for VRAM."""
    if kind is MemoryKind.DRAM:
        return host_view(addr, nbytes)
    import torch

    return torch.as_tensor(_CudaSpan(addr, nbytes), device=f"cuda:{device}")


def _row_bytes(rel: np.ndarray, lengths: np.ndarray) -> int:
    """Largest power of two (<= MAX_ROW_BYTES) dividing every relative offset and length."""
    bits = int(np.bitwise_or.reduce(lengths)) | int(np.bitwise_or.reduce(rel))
    return min(bits & -bits, MAX_ROW_BYTES)


def _row_index(first_rows: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Flat row numbers of the row ranges [first_rows[i], first_rows[i] + counts[i]), concatenated."""
    total = int(counts.sum())
    shift = first_rows - (np.cumsum(counts) - counts)
    return np.repeat(shift, counts) + np.arange(total, dtype=np.int64)


def _copy(kind: MemoryKind, device: int, addrs: np.ndarray, lengths: np.ndarray, staging, to_staging: bool):
    import torch

    off = 0
    total = int(lengths.sum())
    if total == 0:
        return
    # bound the index size: ~MAX_INDEX_ROWS rows per step, in whole rows of the finest granularity
    base_all = int(addrs.min())
    g_all = _row_bytes(addrs - base_all, lengths)
    step = max(g_all, g_all * MAX_INDEX_ROWS)
    for a, n, nb in chunks(addrs, lengths, step):
        out = staging[off:off + nb]
        off += nb
        if a.shape[0] == 1:  # one contiguous range: a plain copy
            view = span_view(kind, device, int(a[0]), nb)
            if to_staging:
                out.copy_(view)
            else:
                view.copy_(out)
            continue
        base = int(a.min())
        rel = a - base
        g = _row_bytes(rel, n)
        span = int((rel + n).max())
        mem = span_view(kind, device, base, span).view(-1, g)
        idx = torch.from_numpy(_row_index(rel // g, n // g))
        if kind is MemoryKind.VRAM:
            idx = idx.to(mem.device, non_blocking=True)
        if to_staging:
            torch.index_select(mem, 0, idx, out=out.view(-1, g))
        elif kind is MemoryKind.DRAM:  # numpy's row scatter is ~3x torch's index_copy_ on CPU
            mem.numpy()[idx.numpy()] = out.view(-1, g).numpy()
        else:
            mem.index_copy_(0, idx, out.view(-1, g))


def gather(kind: MemoryKind, device: int, addrs: np.ndarray, lengths: np.ndarray, staging) -> None:
    """Copy the ranges, concatenated, into the first sum(lengths) bytes of the uint8 tensor `staging`.

    Args:
        kind, device: where the ranges live (staging must be on the same device).
        addrs, lengths: int64 arrays of absolute addresses and byte counts.
        staging: a contiguous 1-D uint8 tensor of at least sum(lengths) bytes.
    Device copies are queued on the current CUDA stream; the caller orders or synchronizes after them.
    """
    _copy(kind, device, addrs, lengths, staging, True)


def scatter(kind: MemoryKind, device: int, addrs: np.ndarray, lengths: np.ndarray, staging) -> None:
    """Copy the first sum(lengths) bytes of `staging` out to the ranges, in order (inverse of gather)."""
    _copy(kind, device, addrs, lengths, staging, False)
