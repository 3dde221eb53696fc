"""The direct path's cheaper plans: a grid plan lists exactly plan_piece's fragments, in order, for random
layouts and block ids; plans written into reused memory (PlanScratch) equal fresh ones, however the memory was
used before; reused memory is never handed out while lent."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvbridge.errors import PlanError
from kvbridge.formatter.layout import POOL_ORDERS, KVLayout, KVShape, ParallelSplit
from kvbridge.formatter.mapping import mapping_for
from kvbridge.formatter.planner import PlanScratch, RankPool, plan_grid, plan_piece


def _pool(layout: KVLayout, rank: int, nb: int, base: int) -> RankPool:
    bases = [base] if not layout.per_layer_pools else [base + j * (1 << 26) for j in range(layout.local_layers(rank))]
    return RankPool.of(layout, rank, bases, nb)


def _cases(seed: int, count: int):
    """(piece, ctx pool, gen pool, ctx ids, gen ids, tokens, first token) for random layout pairs."""
    rng = random.Random(seed)
    for _ in range(count):
        heads = rng.choice([1, 2, 4, 8])
        layers = rng.choice([1, 3, 4])
        ctpb, gtpb = rng.choice([(16, 16), (16, 16), (8, 8), (16, 32)])
        shape = dict(num_layers=layers, num_kv_heads=heads, head_dim=rng.choice([4, 8]), dtype="float16")
        ctx = KVLayout(KVShape(tokens_per_block=ctpb, **shape),
                       ParallelSplit(rng.choice([t for t in (1, 2, 4) if t <= heads or heads % t == 0] or [1]),
                                     rng.choice([1, 1, 2]) if layers > 1 else 1), rng.choice(POOL_ORDERS))
        gen = KVLayout(KVShape(tokens_per_block=gtpb, **shape),
                       ParallelSplit(rng.choice([1, 2]) if heads > 1 else 1), rng.choice(POOL_ORDERS))
        nb = 24
        tokens = rng.choice([ctpb * rng.randint(1, 12), rng.randint(1, 180)])
        first = rng.choice([0, 0, ctpb * rng.randint(0, max(0, tokens // ctpb - 1)), rng.randint(0, tokens - 1)])
        m = mapping_for(ctx, gen)
        g = rng.randrange(gen.world_size)
        gpool = _pool(gen, g, nb, 1 << 44)
        cids, gids = np.array(rng.sample(range(nb), nb)), np.array(rng.sample(range(nb), nb))
        for p in m.pieces(g):
            yield p, _pool(ctx, p.ctx_rank, nb, (1 + p.ctx_rank) << 36), gpool, cids, gids, tokens, first


def test_a_grid_plan_lists_exactly_plan_pieces_fragments_in_order():
    grids = 0
    for p, cp, gp, cids, gids, tokens, first in _cases(7, 300):
        f = plan_piece(p, cp, gp, cids, gids, tokens, first)
        g = plan_grid(p, cp, gp, cids, gids, tokens, first)
        if g is None:  # several segment lengths, or merged runs: the fragments path
            continue
        grids += 1
        gf = g.fragments()
        assert len(g) == len(f) and g.nbytes == f.nbytes
        for a, b in ((gf.src, f.src), (gf.dst, f.dst), (gf.length, f.length)):
            np.testing.assert_array_equal(a, b)
    assert grids > 50  # the common shape (whole scattered blocks) is a grid


def test_the_bench_shape_is_a_grid_and_contiguous_blocks_are_not():
    ctx = KVLayout(KVShape(32, 8, 128, "bfloat16", 16), ParallelSplit(2))
    gen = KVLayout(KVShape(32, 8, 128, "bfloat16", 16), ParallelSplit(1))
    rng = np.random.default_rng(0)
    cp, gp = _pool(ctx, 0, 520, 1 << 36), _pool(gen, 0, 520, 1 << 44)
    (p, _) = mapping_for(ctx, gen).pieces(0)
    g = plan_grid(p, cp, gp, rng.permutation(520)[:512], rng.permutation(520)[:512], 8192)
    assert (g.src_outer.size, g.src_inner.size, g.length) == (64, 512, 16384)
    gp1 = _pool(ctx, 0, 520, 1 << 44)  # identical layouts, adjacent blocks: merged runs, not a grid
    (same,) = mapping_for(ctx, ctx).pieces(0)
    assert plan_grid(same, cp, gp1, np.arange(512), np.arange(512), 8192) is None
    assert len(plan_piece(same, cp, gp1, np.arange(512), np.arange(512), 8192)) == 1


def test_a_grid_plan_validates_block_ids_like_plan_piece():
    ctx = KVLayout(KVShape(2, 2, 4, "float16", 16), ParallelSplit(1))
    cp, gp = _pool(ctx, 0, 8, 1 << 36), _pool(ctx, 0, 8, 1 << 44)
    (p,) = mapping_for(ctx, ctx).pieces(0)
    with pytest.raises(PlanError, match="context block id 8 is outside its pool of 8 blocks"):
        plan_grid(p, cp, gp, np.array([1, 8]), np.array([0, 1]), 32)
    with pytest.raises(PlanError, match="generation gave 1 block ids"):
        plan_grid(p, cp, gp, np.array([1, 2]), np.array([0]), 32)


def test_plans_in_reused_memory_equal_fresh_plans():
    scratch = PlanScratch()
    lent = []
    for i, (p, cp, gp, cids, gids, tokens, first) in enumerate(_cases(11, 200)):
        fresh = plan_piece(p, cp, gp, cids, gids, tokens, first)
        reused = plan_piece(p, cp, gp, cids, gids, tokens, first, scratch)
        for a, b in ((reused.src, fresh.src), (reused.dst, fresh.dst), (reused.length, fresh.length)):
            np.testing.assert_array_equal(a, b)
        lent.append((reused, fresh))
        if i % 3 == 2:  # give some back (and scribble on them first: stale contents must not matter)
            for r, _ in lent[:2]:
                r.src[:] = -1
                scratch.give(r.src)
            lent = lent[2:]
        for r, f in lent:  # what is still lent is never handed out again
            np.testing.assert_array_equal(r.dst, f.dst)


def test_scratch_lends_a_buffer_once_and_equal_lengths_are_shared_and_read_only():
    s = PlanScratch()
    a = s.rows(100, 2)
    b = s.rows(100, 2)
    assert not np.shares_memory(a, b) and s.lent == 2
    s.give(a[1])  # any view of it
    s.give(a)  # given back already: ignored
    assert s.lent == 1
    c = s.rows(50, 3)
    assert np.shares_memory(a, c) and s.lent == 2
    s.give(np.zeros(4, dtype=np.int64))  # not lent by this scratch: ignored
    assert s.lent == 2
    k = s.constant(10, 4096)
    assert s.constant(10, 4096) is k and not k.flags.writeable and (k == 4096).all()
    with pytest.raises(ValueError):
        k[0] = 1
