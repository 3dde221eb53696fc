"""The planner: (context blocks, generation blocks, mapping pieces) -> coalesced (src, dst, length) arrays.

Everything here is vectorised: the cost is a few numpy operations per piece and per distinct segment
length, never a Python step per block or per fragment. Never touches memory: it only does address arithmetic.

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

Step 2 does not depend on block ids: it is cached per (piece, context pool, generation pool) as a plan
template (pools are keyed by identity; a transceiver keeps one RankPool per peer session). A request then
costs its block-id validation, the segment bases and one broadcast add per side into a single allocation.

Block ids come from a peer: they are validated (range, count) here and raise PlanError naming the problem.

A token range: `first_token` > 0 plans only tokens [first_token, n) (prefix reuse: the generation side
already holds the rest). The segments start there; with equal block sizes and a block-aligned start they are
still whole blocks, otherwise the general (in-block offset) path is taken.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..agents import MemoryKind
from ..agents.memory import int_extremes
from ..errors import PlanError
from .layout import KVLayout, PoolAddressing
from .fragments import Fragments, GridPlan, coalesce
from .plan_few import MAX_FRAGMENTS, emit_few, few_ids, plan_few
from .mapping import Piece
from .scratch import PlanScratch

__all__ = ["Fragments", "GridPlan", "RankPool", "PlanScratch", "plan_piece", "plan_grid", "plan_pieces",
           "coalesce", "plan_stats", "clear_plan_cache"]


@dataclass(frozen=True, eq=False)
class RankPool:
    """One rank's KV pool as the planner sees it: its layout, rank and byte addressing.

    Compared and hashed by identity (plan templates are cached per pool object).

    Args:
        tokens_per_block: tokens per block of this pool when it differs from the layout's (a staging buffer
            holds a whole request as one block); 0 means the layout's.
        extent: (global layers, global kv heads) the pool holds when not the rank's own (a staging buffer
            holds one piece); None means the rank's stage layers and head range.
    """

    layout: KVLayout
    rank: int
    addressing: PoolAddressing
    kind: MemoryKind = MemoryKind.DRAM
    device: int = 0
    tokens_per_block: int = 0
    extent: tuple[range, range] | None = None

    @classmethod
    def of(cls, layout: KVLayout, rank: int, bases, num_blocks: int, kind: MemoryKind = MemoryKind.DRAM,
           device: int = 0) -> "RankPool":
        return cls(layout, rank, PoolAddressing.for_rank(layout, rank, list(bases), num_blocks), kind, device)

    @property
    def num_blocks(self) -> int:
        return self.addressing.num_blocks

    @property
    def tpb(self) -> int:
        """Tokens per block of this pool."""
        return self.tokens_per_block or self.layout.shape.tokens_per_block

    def stage_of(self, rank: int) -> range:
        """The global layers of `rank`'s pipeline stage in this pool's layout (kept per rank: asked per read)."""
        stages = self.__dict__.setdefault("_stages", {})  # frozen: the dict itself is the only thing that changes
        got = stages.get(rank)
        if got is None:
            got = stages[rank] = self.layout.stage_layers(self.layout.coords(rank)[1])
        return got

    def held(self) -> tuple[range, range]:
        """(global layers, global kv heads) this pool holds."""
        if self.extent is not None:
            return self.extent
        tp_rank, pp_rank = self.layout.coords(self.rank)
        return self.layout.stage_layers(pp_rank), self.layout.head_range(tp_rank)


# Requests of at most this many blocks take the small-request paths below: their token segments cached, and
# their plans made from Python ints where they can be (plan_few.py).
_FEW = 16
_TEMPLATES: OrderedDict = OrderedDict()  # plan templates (below) and short requests' token segments
_SEGMENTS: OrderedDict = OrderedDict()
_TEMPLATES_MAX = 4096
_TEMPLATES_LOCK = threading.Lock()


def _check_blocks(blocks, need: int, num_blocks: int, side: str) -> np.ndarray:
    b = np.asarray(blocks)
    if b.ndim != 1 or (b.size and b.dtype.kind not in "iu"):
        raise PlanError(f"{side} block ids must be a 1-D integer array")
    b = b.astype(np.int64, copy=False)
    if b.size < need:
        raise PlanError(f"{side} gave {b.size} block ids; {need} are needed for the request's tokens")
    b = b[:need]
    lo, hi = int_extremes(b) if need else (0, 0)  # Python ints for a short request
    if lo < 0 or hi >= num_blocks:
        bad = int(b[(b < 0) | (b >= num_blocks)][0])
        raise PlanError(f"{side} block id {bad} is outside its pool of {num_blocks} blocks")
    return b


def _segment_groups(n: int, tc: int, tg: int, first: int = 0) -> list[tuple[int, np.ndarray]]:
    """Token segments of [first, n) cut at multiples of tc and of tg, grouped by length: [(len, starts)].
    Short requests' answers are kept (read-only arrays): a request of a few blocks asks the same question."""
    key = (n, tc, tg, first)
    got = _SEGMENTS.get(key)
    if got is None:
        got = _segment_groups_new(n, tc, tg, first)
        if n <= _FEW * max(tc, tg):
            for _, starts in got:
                starts.flags.writeable = False
            with _TEMPLATES_LOCK:
                _SEGMENTS[key] = got
                while len(_SEGMENTS) > _TEMPLATES_MAX:
                    _SEGMENTS.popitem(last=False)
    return got


def _segment_groups_new(n: int, tc: int, tg: int, first: int) -> list[tuple[int, np.ndarray]]:
    if tc == tg and first % tc == 0:
        full, rem = divmod(n, tc)
        out = [(tc, np.arange(first, full * tc, tc, dtype=np.int64))] if full * tc > first else []
        if rem:
            out.append((rem, np.array([full * tc], dtype=np.int64)))
        return out
    starts = np.union1d(np.arange(0, n, tc, dtype=np.int64), np.arange(0, n, tg, dtype=np.int64))
    starts = np.union1d(starts[starts > first], np.array([first], dtype=np.int64))
    lens = np.diff(np.append(starts, n))
    return [(int(length), starts[lens == length]) for length in np.unique(lens)]


def _regular(off: np.ndarray) -> int | None:
    """The stride of an arithmetic offset sequence, or None."""
    if off.size < 2:
        return 0
    d = np.diff(off)
    return int(d[0]) if (d == d[0]).all() else None


def _fold(dims: list[tuple[np.ndarray, np.ndarray, int | None, int | None]], unit: int
          ) -> tuple[int, np.ndarray, np.ndarray]:
    """Fold dims into the contiguous run where both sides allow; return (run bytes, src offs, dst offs).

    Each dim is (src offsets, dst offsets, src stride or None, dst stride or None).
    """
    base_s, base_d = 0, 0
    rest = []
    for s, d, rs, rd in dims:
        if s.size == 1:  # extent-1 dims are constants
            base_s += int(s[0])
            base_d += int(d[0])
        else:
            rest.append((s, d, rs, rd))
    changed = True
    while changed:
        changed = False
        for i, (s, d, rs, rd) in enumerate(rest):
            if rs == unit and rd == unit:
                base_s += int(s[0])
                base_d += int(d[0])
                unit *= s.size
                rest.pop(i)
                changed = True
                break
    # enumerate what is left, outermost (largest source stride) first
    rest.sort(key=lambda sd: -abs(int(sd[0][-1] - sd[0][0])))
    off_s = np.array([base_s], dtype=np.int64)
    off_d = np.array([base_d], dtype=np.int64)
    for s, d, _, _ in rest:
        off_s = (off_s[:, None] + s[None, :]).ravel()
        off_d = (off_d[:, None] + d[None, :]).ravel()
    return unit, off_s, off_d


class _Template:
    """A piece's plan between two pools minus block ids: folded dims and offsets per segment length."""

    __slots__ = ("ctx", "gen", "dims", "row", "by_len", "lock")

    def __init__(self, piece: Piece, ctx: RankPool, gen: RankPool) -> None:
        (cl, ch), (gl, gh) = ctx.held(), gen.held()
        for side, layers, heads in (("context", cl, ch), ("generation", gl, gh)):
            if piece.layers.start < layers.start or piece.layers.stop > layers.stop or \
                    piece.heads.start < heads.start or piece.heads.stop > heads.stop or not piece.layers or \
                    not piece.heads:
                raise PlanError(f"{piece!r} is not inside the {side} pool (layers {layers.start}.."
                                f"{layers.stop - 1}, heads {heads.start}..{heads.stop - 1})")
        ca, ga = ctx.addressing, gen.addressing
        if ca.row_bytes != ga.row_bytes:
            raise PlanError(f"row sizes differ: context {ca.row_bytes} bytes, generation {ga.row_bytes}")
        lc0, lg0, nl = piece.layers.start - cl.start, piece.layers.start - gl.start, len(piece.layers)
        hs = np.arange(len(piece.heads), dtype=np.int64)
        hc, hg = piece.heads.start - ch.start + hs, piece.heads.start - gh.start + hs
        kv = np.arange(ctx.layout.shape.kv_factor, dtype=np.int64)
        self.ctx, self.gen, self.row = ctx, gen, ca.row_bytes
        dims = [
            (ca.layer_base[lc0:lc0 + nl], ga.layer_base[lg0:lg0 + nl]),
            (kv * ca.kv_stride, kv * ga.kv_stride),
            (hc * ca.head_stride, hg * ga.head_stride),
        ]
        self.dims = [(s, d, _regular(s), _regular(d)) for s, d in dims]
        self.by_len: dict[int, tuple[int, np.ndarray, np.ndarray]] = {}
        self.lock = threading.Lock()

    def for_length(self, length: int) -> tuple[int, np.ndarray, np.ndarray]:
        """(run bytes, src offsets, dst offsets) of a token segment of `length` tokens."""
        got = self.by_len.get(length)
        if got is None:
            t = np.arange(length, dtype=np.int64)
            ts_c, ts_g = self.ctx.addressing.token_stride, self.gen.addressing.token_stride
            got = _fold(self.dims + [(t * ts_c, t * ts_g, ts_c, ts_g)], self.row)
            with self.lock:
                self.by_len[length] = got
        return got


def _template(piece: Piece, ctx: RankPool, gen: RankPool) -> _Template:
    # pools hash by identity and the key keeps them alive, so ids are never reused; eviction is first-in
    # first-out (a hit costs one dict lookup, no lock); an evicted template is rebuilt on its next use
    key = (ctx, gen, piece)
    t = _TEMPLATES.get(key)
    if t is None:
        t = _Template(piece, ctx, gen)
        with _TEMPLATES_LOCK:
            _TEMPLATES[key] = t
            while len(_TEMPLATES) > _TEMPLATES_MAX:
                _TEMPLATES.popitem(last=False)
    return t


def clear_plan_cache() -> None:
    """Forget every cached plan template (e.g. when a peer's pools are dropped)."""
    with _TEMPLATES_LOCK:
        _TEMPLATES.clear()
        _SEGMENTS.clear()


def _validate(ctx: RankPool, gen: RankPool, ctx_blocks, gen_blocks, num_tokens,
              first_token: int = 0) -> tuple[int, np.ndarray, np.ndarray]:
    n = int(num_tokens)
    if n <= 0:
        raise PlanError(f"a request needs at least one token, got {num_tokens}")
    if not 0 <= int(first_token) < n:
        raise PlanError(f"first token {first_token} to copy is outside the request's {n} tokens")
    cb = _check_blocks(ctx_blocks, -(-n // ctx.tpb), ctx.num_blocks, "context")
    gb = _check_blocks(gen_blocks, -(-n // gen.tpb), gen.num_blocks, "generation")
    return n, cb, gb


def _prepare(piece: Piece, ctx: RankPool, gen: RankPool, cb: np.ndarray, gb: np.ndarray, n: int,
             first: int = 0) -> list:
    """Per segment length: (src offsets, dst offsets, segment bases per side, run bytes) of a piece's plan."""
    tpl = _template(piece, ctx, gen)
    ca, ga = ctx.addressing, gen.addressing
    tc, tg = ctx.tpb, gen.tpb
    todo = []
    for length, starts in _segment_groups(n, tc, tg, first):
        unit, off_s, off_d = tpl.for_length(length)
        if tc == tg and first % tc == 0:  # whole blocks (the last one maybe partial): no in-block offsets
            first = int(starts[0]) // tc
            ss = cb[first:first + starts.size] * ca.block_stride
            sd = gb[first:first + starts.size] * ga.block_stride
            can_merge = starts.size > 1 and unit == ca.block_stride and unit == ga.block_stride
        else:
            ss = cb[starts // tc] * ca.block_stride + (starts % tc) * ca.token_stride
            sd = gb[starts // tg] * ga.block_stride + (starts % tg) * ga.token_stride
            can_merge = starts.size > 1
        runs = unit
        if can_merge:
            # Consecutive segments contiguous on both sides merge into one run; the test does not depend on
            # the outer offset, so runs are found once over segments, not over fragments.
            brk = np.ones(ss.size, dtype=bool)
            brk[1:] = (np.diff(ss) != unit) | (np.diff(sd) != unit) | (np.diff(starts) != length)
            heads = np.flatnonzero(brk)
            if heads.size < ss.size:
                runs = np.diff(np.append(heads, ss.size)) * unit
                ss, sd = ss[heads], sd[heads]
        todo.append((off_s, off_d, ss, sd, runs))
    return todo


def _emit(todo: list, out: np.ndarray, pos: int, lengths: bool = True) -> int:
    """Write a prepared plan into out[:, pos:] (rows src, dst and, if `lengths`, length); return the end."""
    for off_s, off_d, ss, sd, runs in todo:
        k, r = off_s.size, ss.size
        np.add(off_s[:, None], ss[None, :], out=out[0, pos:pos + k * r].reshape(k, r))
        np.add(off_d[:, None], sd[None, :], out=out[1, pos:pos + k * r].reshape(k, r))
        if not lengths:
            pass
        elif isinstance(runs, int):
            out[2, pos:pos + k * r] = runs
        else:
            out[2, pos:pos + k * r].reshape(k, r)[:] = runs[None, :]
        pos += k * r
    return pos


def _count(todo: list) -> int:
    return sum(t[0].size * t[2].size for t in todo)


def plan_piece(piece: Piece, ctx: RankPool, gen: RankPool, ctx_blocks, gen_blocks,
               num_tokens: int, first_token: int = 0, scratch: PlanScratch | None = None) -> Fragments:
    """Fragments that copy `piece` of a request's first `num_tokens` tokens from ctx's blocks to gen's.

    Args:
        piece: global layers and kv heads to copy; must lie inside both pools.
        ctx, gen: source and destination pools.
        ctx_blocks, gen_blocks: block ids of the request on each side (only the first ceil(n / tpb) are used).
        num_tokens: the request's token count n.
        first_token: copy only tokens [first_token, n) (the generation side holds the others).
        scratch: where the arrays come from when given (see PlanScratch: memory used before, so no page
            faults; equal lengths as one shared read-only array); None: new arrays.
    Returns:
        Fragments (src in ctx's pool, dst in gen's), adjacent runs already merged.
    """
    n, first, t = int(num_tokens), int(first_token), ctx.tpb
    if t == gen.tpb and 0 <= first < n <= _FEW * t and not first % t:  # short: plan_few.py, if it can
        cb, gb = few_ids(ctx_blocks, -(-n // t), ctx.num_blocks), few_ids(gen_blocks, -(-n // t), gen.num_blocks)
        if cb is not None and gb is not None:
            got = plan_few(_template(piece, ctx, gen), cb, gb, n, first, t, ctx.addressing.block_stride,
                           gen.addressing.block_stride)
            if got is not None:
                return got
    n, cb, gb = _validate(ctx, gen, ctx_blocks, gen_blocks, num_tokens, first_token)
    todo = _prepare(piece, ctx, gen, cb, gb, n, first)
    count = _count(todo)
    if count <= MAX_FRAGMENTS:  # a few fragments: Python ints, one array made at the end
        return emit_few(todo)
    if scratch is None:
        out = np.empty((3, count), dtype=np.int64)
        _emit(todo, out, 0)
        return Fragments(out[0], out[1], out[2])
    run = _uniform_run(todo)
    out = scratch.rows(count, 2 if run else 3)
    _emit(todo, out, 0, lengths=not run)
    return Fragments(out[0], out[1], scratch.constant(count, run) if run else out[2])


def plan_grid(piece: Piece, ctx: RankPool, gen: RankPool, ctx_blocks, gen_blocks, num_tokens: int,
              first_token: int = 0) -> GridPlan | None:
    """`plan_piece` as a GridPlan when its fragments form one (one token-segment length and no merged runs:
    scattered whole blocks, the usual case), else None. Same validation and errors as `plan_piece`; costs
    the block ids' checks and a few arrays of (layers x K/V) and (blocks) entries, nothing per fragment."""
    n, cb, gb = _validate(ctx, gen, ctx_blocks, gen_blocks, num_tokens, first_token)
    todo = _prepare(piece, ctx, gen, cb, gb, n, int(first_token))
    if len(todo) != 1 or not isinstance(todo[0][4], int) or not todo[0][2].size:
        return None
    off_s, off_d, ss, sd, run = todo[0]
    return GridPlan(off_s, ss, off_d, sd, run)


def _uniform_run(todo: list) -> int:
    """The one fragment length of a prepared plan whose runs all have it, else 0."""
    runs = {t[4] for t in todo if isinstance(t[4], int)}
    return runs.pop() if len(runs) == 1 and all(isinstance(t[4], int) for t in todo) else 0


def plan_stats(piece: Piece, ctx: RankPool, gen: RankPool, num_tokens: int) -> int:
    """Fragments of `piece` before adjacent segments are merged (one per contiguous run per token segment)."""
    tpl = _template(piece, ctx, gen)
    return sum(tpl.for_length(length)[1].size * starts.size
               for length, starts in _segment_groups(int(num_tokens), ctx.tpb, gen.tpb))


def plan_pieces(pieces, ctx_pools: dict[int, RankPool], gen: RankPool, ctx_blocks, gen_blocks,
                num_tokens: int, first_token: int = 0) -> dict[int, Fragments]:
    """Fragments per context rank for every piece a generation rank reads (one read per context rank).

    Args:
        pieces: the generation rank's pieces (RankMapping.pieces).
        ctx_pools: context rank -> its pool.
        gen: the generation rank's pool.
        ctx_blocks, gen_blocks, num_tokens, first_token: as for `plan_piece` (the same block ids on every
            context rank).
    Returns:
        context rank -> Fragments; all of them views into one allocation.
    """
    plans: dict[int, list] = {}
    checked: dict[int, np.ndarray] = {}
    n = gb = None
    for p in pieces:
        pool = ctx_pools[p.ctx_rank]
        key = (pool.num_blocks, pool.tpb)
        if key not in checked:
            n, checked[key], gb = _validate(pool, gen, ctx_blocks, gen_blocks, num_tokens, first_token)
        plans.setdefault(p.ctx_rank, []).append(_prepare(p, pool, gen, checked[key], gb, n, int(first_token)))
    total = sum(_count(t) for todos in plans.values() for t in todos)
    out = np.empty((3, total), dtype=np.int64)
    res, pos = {}, 0
    for r, todos in plans.items():
        start = pos
        for t in todos:
            pos = _emit(t, out, pos)
        f = Fragments(out[0, start:pos], out[1, start:pos], out[2, start:pos])
        res[r] = f if len(todos) == 1 else coalesce(f)
    return res
