"""The planner: (context blocks, generation blocks, mapping pieces) -> coalesced (src, dst, length) arrays.

Everything here is vectorised: the cost is a few numpy operations per piece and per distinct segment
length, never a Python step per block or per fragment.

How a piece becomes fragments:
1. Token segments. The request's tokens [0, n) are cut at every context block boundary and every generation
   block boundary (tokens_per_block may differ); inside a segment both sides are linear in the token.
   Each segment has a base address on each side (block id * block stride + offset in block).
2. Dimensions. Inside a segment the piece is a small tensor [layers, kv, heads, tokens] of rows
   (head_dim * itemsize contiguous bytes). A dimension whose stride equals the current contiguous run on
   BOTH sides is folded into the run (e.g. tokens, then heads when whole blocks of all heads are copied); the
   rest are enumerated by broadcasting their offsets. Segments of the same length share this work.
3. Runs. Consecutive segments that are contiguous on both sides (adjacent block ids, when the folded run is
   a whole block) merge into one run; this is decided once over segments, then broadcast over the outer
   offsets, so no pass over the (possibly 100k) fragments is needed.

Block ids come from a peer: they are validated (range, count) here and raise PlanError naming the problem.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..agents import MemoryKind
from ..errors import PlanError
from .layout import KVLayout, PoolAddressing
from .mapping import Piece

__all__ = ["Fragments", "RankPool", "plan_piece", "plan_pieces", "coalesce"]


@dataclass(frozen=True, slots=True, eq=False)
class Fragments:
    """Byte ranges to copy: fragment i is `length[i]` bytes from `src[i]` to `dst[i]` (int64 arrays)."""

    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray

    def __len__(self) -> int:
        return int(self.src.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    @staticmethod
    def empty() -> "Fragments":
        z = np.zeros(0, dtype=np.int64)
        return Fragments(z, z, z)

    @staticmethod
    def concat(parts: list["Fragments"]) -> "Fragments":
        parts = [p for p in parts if len(p)]
        if not parts:
            return Fragments.empty()
        if len(parts) == 1:
            return parts[0]
        return Fragments(np.concatenate([p.src for p in parts]), np.concatenate([p.dst for p in parts]),
                         np.concatenate([p.length for p in parts]))


@dataclass(frozen=True)
class RankPool:
    """One rank's KV pool as the planner sees it: its layout, rank and byte addressing."""

    layout: KVLayout
    rank: int
    addressing: PoolAddressing
    kind: MemoryKind = MemoryKind.DRAM
    device: int = 0

    @classmethod
    def of(cls, layout: KVLayout, rank: int, bases, num_blocks: int, kind: MemoryKind = MemoryKind.DRAM,
           device: int = 0) -> "RankPool":
        return cls(layout, rank, PoolAddressing.for_rank(layout, rank, list(bases), num_blocks), kind, device)

    @property
    def num_blocks(self) -> int:
        return self.addressing.num_blocks


def coalesce(f: Fragments) -> Fragments:
    """Merge neighbours (in array order) that are contiguous on both sides. Vectorised."""
    n = len(f)
    if n < 2:
        return f
    brk = np.empty(n, dtype=bool)
    brk[0] = True
    end_s = f.src[:-1] + f.length[:-1]
    end_d = f.dst[:-1] + f.length[:-1]
    np.not_equal(end_s, f.src[1:], out=brk[1:])
    brk[1:] |= end_d != f.dst[1:]
    starts = np.flatnonzero(brk)
    if starts.size == n:
        return f
    return Fragments(f.src[starts], f.dst[starts], np.add.reduceat(f.length, starts))


def _check_blocks(blocks: np.ndarray, need: int, num_blocks: int, side: str) -> np.ndarray:
    b = np.asarray(blocks)
    if b.ndim != 1 or (b.size and not np.issubdtype(b.dtype, np.integer)):
        raise PlanError(f"{side} block ids must be a 1-D integer array")
    b = b.astype(np.int64, copy=False)
    if b.size < need:
        raise PlanError(f"{side} gave {b.size} block ids; {need} are needed for the request's tokens")
    b = b[:need]
    if need and (b.min() < 0 or b.max() >= num_blocks):
        bad = int(b[(b < 0) | (b >= num_blocks)][0])
        raise PlanError(f"{side} block id {bad} is outside its pool of {num_blocks} blocks")
    return b


def _segments(n: int, tc: int, tg: int) -> tuple[np.ndarray, np.ndarray]:
    """Start and length of the token segments of [0, n) cut at multiples of tc and of tg."""
    if tc == tg:
        starts = np.arange(0, n, tc, dtype=np.int64)
    else:
        starts = np.union1d(np.arange(0, n, tc, dtype=np.int64), np.arange(0, n, tg, dtype=np.int64))
    ends = np.empty_like(starts)
    ends[:-1] = starts[1:]
    if starts.size:
        ends[-1] = n
    return starts, ends - starts


def _regular(off: np.ndarray) -> int | None:
    """The stride of an arithmetic offset sequence, or None."""
    if off.size < 2:
        return 0
    d = np.diff(off)
    return int(d[0]) if (d == d[0]).all() else None


def _piece_dims(piece: Piece, ctx: RankPool, gen: RankPool) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
    """Per-side offsets of the piece's layer, kv and head dimensions (token dim handled per segment)."""
    cl, gl = ctx.layout, gen.layout
    ca, ga = ctx.addressing, gen.addressing
    c_tp, c_pp = cl.coords(ctx.rank)
    g_tp, g_pp = gl.coords(gen.rank)
    lc0 = piece.layers.start - cl.stage_layers(c_pp).start
    lg0 = piece.layers.start - gl.stage_layers(g_pp).start
    nl = len(piece.layers)
    hc0 = piece.heads.start - cl.head_range(c_tp).start
    hg0 = piece.heads.start - gl.head_range(g_tp).start
    nh = len(piece.heads)
    kv = np.arange(cl.shape.kv_factor, dtype=np.int64)
    hs = np.arange(nh, dtype=np.int64)
    dims = [
        (ca.layer_base[lc0:lc0 + nl], ga.layer_base[lg0:lg0 + nl]),
        (kv * ca.kv_stride, kv * ga.kv_stride),
        ((hc0 + hs) * ca.head_stride, (hg0 + hs) * ga.head_stride),
    ]
    return dims, ca.row_bytes


def _fold(dims: list[tuple[np.ndarray, np.ndarray]], unit: int) -> tuple[int, np.ndarray, np.ndarray]:
    """Fold dims into the contiguous run where both sides allow; return (run bytes, src offs, dst offs)."""
    base_s = np.int64(0)
    base_d = np.int64(0)
    rest = []
    for s, d in dims:
        if s.size == 1:  # extent-1 dims are constants
            base_s += s[0]
            base_d += d[0]
        else:
            rest.append((s, d))
    changed = True
    while changed:
        changed = False
        for i, (s, d) in enumerate(rest):
            if _regular(s) == unit and _regular(d) == unit:
                base_s += s[0]
                base_d += d[0]
                unit *= s.size
                rest.pop(i)
                changed = True
                break
    # enumerate what is left, outermost (largest source stride) first
    rest.sort(key=lambda sd: -abs(int(sd[0][-1] - sd[0][0])) if sd[0].size > 1 else 0)
    off_s = np.array([base_s], dtype=np.int64)
    off_d = np.array([base_d], dtype=np.int64)
    for s, d in rest:
        off_s = (off_s[:, None] + s[None, :]).ravel()
        off_d = (off_d[:, None] + d[None, :]).ravel()
    return unit, off_s, off_d


def plan_piece(piece: Piece, ctx: RankPool, gen: RankPool, ctx_blocks, gen_blocks, num_tokens: int) -> Fragments:
    """Fragments that copy `piece` of a request's first `num_tokens` tokens from ctx's blocks to gen's."""
    n = int(num_tokens)
    if n <= 0:
        raise PlanError(f"a request needs at least one token, got {num_tokens}")
    ca, ga = ctx.addressing, gen.addressing
    tc, tg = ctx.layout.shape.tokens_per_block, gen.layout.shape.tokens_per_block
    cb = _check_blocks(ctx_blocks, -(-n // tc), ca.num_blocks, "context")
    gb = _check_blocks(gen_blocks, -(-n // tg), ga.num_blocks, "generation")
    starts, lens = _segments(n, tc, tg)
    seg_s = cb[starts // tc] * ca.block_stride + (starts % tc) * ca.token_stride
    seg_d = gb[starts // tg] * ga.block_stride + (starts % tg) * ga.token_stride
    dims, row = _piece_dims(piece, ctx, gen)
    parts = []
    for length in np.unique(lens):
        sel = np.flatnonzero(lens == length)
        t = np.arange(int(length), dtype=np.int64)
        unit, off_s, off_d = _fold(dims + [(t * ca.token_stride, t * ga.token_stride)], row)
        ss, sd = seg_s[sel], seg_d[sel]
        # Consecutive segments contiguous on both sides (adjacent block ids) merge into one run; the test
        # does not depend on the outer offset, so runs are found once over segments, not over fragments.
        brk = np.ones(ss.size, dtype=bool)
        brk[1:] = (np.diff(ss) != unit) | (np.diff(sd) != unit) | (np.diff(sel) != 1)
        starts_ = np.flatnonzero(brk)
        run_bytes = np.diff(np.append(starts_, ss.size)) * unit
        k, r = off_s.size, starts_.size
        src = np.empty((k, r), dtype=np.int64)
        dst = np.empty((k, r), dtype=np.int64)
        np.add(off_s[:, None], ss[starts_][None, :], out=src)
        np.add(off_d[:, None], sd[starts_][None, :], out=dst)
        if (run_bytes == run_bytes[0]).all():
            length = np.full(k * r, run_bytes[0], dtype=np.int64)
        else:
            length = np.tile(run_bytes, k)
        parts.append(Fragments(src.reshape(-1), dst.reshape(-1), length))
    return Fragments.concat(parts)


def plan_pieces(pieces, ctx_pools: dict[int, RankPool], gen: RankPool, ctx_blocks, gen_blocks,
                num_tokens: int) -> dict[int, Fragments]:
    """Fragments per context rank for every piece a generation rank reads (one read per context rank)."""
    by_rank: dict[int, list[Fragments]] = {}
    for p in pieces:
        by_rank.setdefault(p.ctx_rank, []).append(
            plan_piece(p, ctx_pools[p.ctx_rank], gen, ctx_blocks, gen_blocks, num_tokens))
    return {r: fs[0] if len(fs) == 1 else coalesce(Fragments.concat(fs)) for r, fs in by_rank.items()}
