"""Plans of short requests from Python ints: a few whole blocks (the last maybe partial), the same block size on
both sides. The control plane plans one such request per pull; numpy's fixed cost per call (a microsecond or
more, several when caches are cold) was most of planning it, so here the block ids, their checks, the segment
bases and the fragments are plain lists, and one array is made at the end.

The same fragments, in the same order and merged the same way, as the planner's general path (planner.py,
`_prepare` then `_emit`: outer offsets, then segments; consecutive whole blocks contiguous on both sides merge
when the folded run is a whole block); `tests/transceiver/test_small_paths.py` compares the two. Anything
else (other block sizes, a token range that starts inside a block, ids that are not a 1-D integer array or
are out of range) returns None: the general path then plans it, or raises the PlanError naming what was wrong.
Pure arithmetic; never touches memory.
"""

from __future__ import annotations

import numpy as np

from .fragments import Fragments

__all__ = ["few_ids", "plan_few", "emit_few"]

MAX_FRAGMENTS = 64  # beyond this many fragments numpy's vectorised path is the cheaper one


def few_ids(blocks, need: int, num_blocks: int) -> list[int] | None:
    """The first `need` ids of a 1-D integer array as Python ints, if every one lies in [0, num_blocks); else
    None (the general path's checks then name the problem)."""
    if not (isinstance(blocks, np.ndarray) and blocks.ndim == 1 and blocks.dtype.kind in "iu"):
        return None
    ids = blocks[:need].tolist()
    if len(ids) < need or not ids or min(ids) < 0 or max(ids) >= num_blocks:
        return None
    return ids


def plan_few(tpl, cb: list[int], gb: list[int], n: int, first: int, tpb: int, bs_c: int, bs_g: int
             ) -> Fragments | None:
    """Fragments of a request of n tokens from token `first` (a multiple of tpb) whose ids are `cb` / `gb`, from
    plan template `tpl` (the planner's `_Template`: run bytes and offsets per token-segment length); block
    strides `bs_c` / `bs_g`. None when it would make more than MAX_FRAGMENTS fragments."""
    full, rem = divmod(n, tpb)
    groups = []
    if full > first // tpb:  # whole blocks: one segment each
        unit, off_s, off_d = tpl.for_length(tpb)
        ss = [cb[i] * bs_c for i in range(first // tpb, full)]
        sd = [gb[i] * bs_g for i in range(first // tpb, full)]
        runs = [unit] * len(ss)
        if len(ss) > 1 and unit == bs_c and unit == bs_g:  # whole blocks adjacent on both sides: one run
            ms, md, runs = [ss[0]], [sd[0]], [unit]
            for a, b, pa, pb in zip(ss[1:], sd[1:], ss, sd):
                if a - pa == unit and b - pb == unit:
                    runs[-1] += unit
                else:
                    ms.append(a)
                    md.append(b)
                    runs.append(unit)
            ss, sd = ms, md
        groups.append((off_s, off_d, ss, sd, runs))
    if rem:  # the partial last block
        unit, off_s, off_d = tpl.for_length(rem)
        groups.append((off_s, off_d, [cb[full] * bs_c], [gb[full] * bs_g], [unit]))
    if sum(g[0].size * len(g[2]) for g in groups) > MAX_FRAGMENTS:
        return None
    return emit_few([(off_s.tolist(), off_d.tolist(), ss, sd, runs) for off_s, off_d, ss, sd, runs in groups])


def emit_few(todo: list) -> Fragments:
    """Fragments of prepared groups (outer offsets, outer offsets, segment bases, segment bases, run bytes: lists,
    or the planner's arrays and ints), outer offset first, as new arrays."""
    src: list[int] = []
    dst: list[int] = []
    length: list[int] = []
    for off_s, off_d, ss, sd, runs in todo:
        ss_l = ss if isinstance(ss, list) else ss.tolist()
        sd_l = sd if isinstance(sd, list) else sd.tolist()
        run_l = runs if isinstance(runs, list) else [runs] * len(ss_l) if isinstance(runs, int) else runs.tolist()
        for a, b in zip(off_s if isinstance(off_s, list) else off_s.tolist(),
                        off_d if isinstance(off_d, list) else off_d.tolist()):
            src += [a + x for x in ss_l]
            dst += [b + y for y in sd_l]
            length += run_l
    out = np.array((src, dst, length), dtype=np.int64).reshape(3, len(src))
    return Fragments(out[0], out[1], out[2])
