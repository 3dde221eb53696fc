"""The planner: peer block ids validated with named errors, coalescing, cached templates equal fresh plans."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.errors import PlanError
from kvbridge.formatter.layout import KVLayout, KVShape, ParallelSplit
from kvbridge.formatter.mapping import Piece, mapping_for
from kvbridge.formatter.planner import (Fragments, RankPool, clear_plan_cache, coalesce, plan_piece,
                                        plan_pieces, plan_stats)


def _layout(tp=1, pp=1, tpb=16, order="block_major", heads=4):
    return KVLayout(KVShape(4, heads, 8, "float16", tpb), ParallelSplit(tp, pp), order)


def _pools(ctx, gen, nb=64):
    cp = {r: RankPool.of(ctx, r, [(1 + r) << 32] if ctx.order == "block_major" else
                         [((1 + r) << 32) + j * (1 << 24) for j in range(ctx.local_layers(r))], nb)
          for r in range(ctx.world_size)}
    return cp, RankPool.of(gen, 0, [1 << 40], nb)


def test_identity_with_adjacent_blocks_is_one_fragment_and_scattered_blocks_one_per_block():
    a = _layout()
    cp, gp = _pools(a, a)
    (p,) = mapping_for(a, a).pieces(0)
    f = plan_piece(p, cp[0], gp, np.arange(3, 10), np.arange(20, 27), 7 * 16)
    assert len(f) == 1 and f.nbytes == 7 * a.block_bytes(0)
    f = plan_piece(p, cp[0], gp, np.array([3, 9, 5]), np.array([1, 2, 3]), 40)  # last block partial
    # two whole blocks (context ids not adjacent), then the partial block: one run per (layer, K/V, head)
    assert len(f) == 2 + 4 * 2 * 4
    assert plan_stats(p, cp[0], gp, 40) == len(f)


@pytest.mark.parametrize("bad,why", [
    (np.array([1, 2]), "context gave 2 block ids; 3 are needed"),
    (np.array([1, 2, 64]), "context block id 64 is outside its pool of 64 blocks"),
    (np.array([1, -1, 2]), "context block id -1 is outside"),
    (np.array([[1, 2, 3]]), "context block ids must be a 1-D integer array"),
    (np.array([1.0, 2.0, 3.0]), "context block ids must be a 1-D integer array"),
])
def test_bad_peer_block_ids_raise_plan_error_naming_the_problem(bad, why):
    a = _layout()
    cp, gp = _pools(a, a)
    (p,) = mapping_for(a, a).pieces(0)
    with pytest.raises(PlanError, match=why):
        plan_piece(p, cp[0], gp, bad, np.arange(3), 40)
    with pytest.raises(PlanError, match="generation block id 99"):
        plan_pieces([p], cp, gp, np.arange(3), np.array([0, 99, 1]), 40)
    with pytest.raises(PlanError, match="at least one token"):
        plan_piece(p, cp[0], gp, np.arange(3), np.arange(3), 0)


def test_a_piece_outside_either_pool_is_refused():
    ctx, gen = _layout(tp=2), _layout(tp=4)
    cp, gp = _pools(ctx, gen)
    with pytest.raises(PlanError, match="not inside the generation pool"):
        plan_piece(Piece(0, range(0, 4), range(0, 2)), cp[0], gp, np.arange(2), np.arange(2), 20)
    with pytest.raises(PlanError, match="not inside the context pool"):
        plan_piece(Piece(1, range(0, 4), range(0, 1)), cp[1], gp, np.arange(2), np.arange(2), 20)


def test_cached_template_plans_equal_fresh_ones_for_new_block_ids_and_lengths():
    ctx, gen = _layout(tp=2, tpb=16, order="layer_pools"), _layout(tp=4, tpb=48)
    cp, gp = _pools(ctx, gen)
    pieces = mapping_for(ctx, gen).pieces(0)
    rng = np.random.default_rng(5)
    for n in (1, 47, 48, 49, 300, 17):
        cb, gb = rng.permutation(64), rng.permutation(64)
        cached = plan_pieces(pieces, cp, gp, cb, gb, n)
        clear_plan_cache()
        fresh = plan_pieces(pieces, cp, gp, cb, gb, n)
        for r in fresh:
            for a, b in ((cached[r].src, fresh[r].src), (cached[r].dst, fresh[r].dst),
                         (cached[r].length, fresh[r].length)):
                assert np.array_equal(a, b)


def test_equal_pools_that_are_different_objects_do_not_share_a_template():
    a = _layout()
    (p,) = mapping_for(a, a).pieces(0)
    g1, g2 = RankPool.of(a, 0, [1 << 40], 8), RankPool.of(a, 0, [2 << 40], 8)
    c = RankPool.of(a, 0, [1 << 30], 8)
    f1 = plan_piece(p, c, g1, np.arange(2), np.arange(2), 32)
    f2 = plan_piece(p, c, g2, np.arange(2), np.arange(2), 32)
    assert np.array_equal(f2.dst - f1.dst, np.full(len(f1), 1 << 40))


def test_coalesce_merges_only_runs_contiguous_on_both_sides():
    f = Fragments(np.array([100, 110, 200, 210]), np.array([0, 10, 20, 40]), np.array([10, 10, 10, 10]))
    c = coalesce(f)
    assert c.src.tolist() == [100, 200, 210] and c.dst.tolist() == [0, 20, 40]
    assert c.length.tolist() == [20, 10, 10]
    assert c.nbytes == f.nbytes and f.mean_bytes == 10.0
