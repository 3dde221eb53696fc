"""The staged (pack -> one read -> unpack) path: byte-exact over the matrix, canonical order, path choice."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.errors import PlanError
from kvbridge.formatter.layout import KVLayout, KVShape, ParallelSplit
from kvbridge.formatter.mapping import Piece, mapping_for
from kvbridge.formatter.planner import Fragments, RankPool, plan_pieces
from kvbridge.formatter.staging import (DEFAULT_THRESHOLD_BYTES, choose_path, plan_pack, staged_read,
                                        staging_nbytes, staging_pool)
from kvbridge.formatter.verify import Arena, element_codes, pool_image, verify_split

from .cells import all_cells, sample


def _staged_sample():
    """Matrix cells covering every TP pair x heads, PP pair x block pair, heads x block pair, pool order."""
    seen, out = set(), []
    for c in sample(all_cells()):
        kinds = [k for k in c.kinds() if k[0] != "world"] + [("order", c.variant()["order"])]
        if any(k not in seen for k in kinds):
            seen.update(kinds)
            out.append(c)
    return out


STAGED = _staged_sample()


def test_staged_path_is_byte_exact_over_a_sample_of_the_matrix():
    failures = []
    for cell in STAGED:
        ctx, gen = cell.layouts()
        v = cell.variant()
        res = verify_split(ctx, gen, v["tokens"], seed=v["seed"], path="staged")
        if not res.ok:
            failures.append(f"{cell.cli()} (staged)\n    {res.summary()}")
        # one read per piece: exactly as many descriptors as context ranks read from
        m = mapping_for(ctx, gen)
        assert res.fragments == {g: len(m.pieces(g)) for g in range(gen.world_size)}
    assert not failures, "\n".join(failures)
    assert len(STAGED) > 150
    print(f"\nstaged path: {len(STAGED)} matrix cells byte-exact")


def _layout(order="block_major", tp=1, pp=1, heads=6, mla=False, tpb=16):
    return KVLayout(KVShape(5, 1 if mla else heads, 4, "bfloat16", tpb, mla), ParallelSplit(tp, pp), order)


@pytest.mark.parametrize("order", ["block_major", "layer_pools"])
@pytest.mark.parametrize("mla", [False, True])
def test_staging_buffer_holds_the_piece_in_canonical_order(order, mla):
    ctx = _layout(order, tp=2 if not mla else 3, pp=1, mla=mla)
    n, nb = 37, 6
    blocks = np.array([4, 1, 5], dtype=np.int64)
    piece = Piece(1, range(1, 4), range(0, 1) if mla else range(4, 6))  # rank 1 holds heads 3..5
    pool_bytes = ctx.block_bytes(1) * nb
    arena = Arena([pool_bytes, staging_nbytes(ctx, piece, n)])
    if order == "block_major":
        bases = [arena.addr(0)]
    else:
        bases = [arena.addr(0) + j * (pool_bytes // 5) for j in range(5)]
    pool = RankPool.of(ctx, 1, bases, nb)
    arena.view(0, pool_bytes)[:] = pool_image(ctx, 1, nb, [(blocks, n, 0)], 9)
    stage = staging_pool(ctx, piece, arena.addr(1), n)
    arena.execute(plan_pack(piece, pool, stage, blocks, n))
    L, K, H, T, D = np.ix_(np.arange(1, 4), np.arange(1 if mla else 2), np.arange(piece.heads.start,
                           piece.heads.stop), np.arange(n), np.arange(4))
    want = element_codes(L, K, H, T, D, 2, salt=17).reshape(-1)
    assert np.array_equal(arena.view(1, want.size), want)


def test_a_layer_prefix_of_the_piece_is_a_prefix_of_its_staging_buffer():
    ctx = _layout(tp=3)
    whole, first2 = Piece(0, range(0, 5), range(0, 2)), Piece(0, range(0, 2), range(0, 2))
    a = staging_pool(ctx, whole, 1 << 20, 50)
    b = staging_pool(ctx, first2, 1 << 20, 50)
    assert np.array_equal(a.addressing.layer_base[:2], b.addressing.layer_base)
    assert staging_nbytes(ctx, first2, 50) == 2 * staging_nbytes(ctx, whole, 50) // 5


def _llama(tp):
    return KVLayout(KVShape(80, 8, 128, "bfloat16", 16), ParallelSplit(tp))


def _direct(ctx, gen, n=4096):
    m = mapping_for(ctx, gen)
    pools = {r: RankPool.of(ctx, r, [(1 + r) << 40], 1024) for r in range(ctx.world_size)}
    rng = np.random.default_rng(0)
    out = plan_pieces(m.pieces(0), pools, RankPool.of(gen, 0, [1 << 50], 1024),
                      rng.permutation(1024), rng.permutation(1024), n)
    return next(iter(out.values()))


def test_choose_path_stages_small_fragments_and_reads_large_ones_directly():
    small = _direct(_llama(8), _llama(4))  # one head of one layer of one block: 4 KiB each
    assert small.mean_bytes == 4096 and choose_path(small) == "staged"
    whole = _direct(_llama(8), _llama(8))  # whole blocks of every layer: 640 KiB each
    assert whole.mean_bytes > DEFAULT_THRESHOLD_BYTES and choose_path(whole) == "direct"
    few = Fragments(np.arange(1, 11), np.arange(1, 11), np.ones(10, dtype=np.int64))
    assert choose_path(few) == "direct"  # too few descriptors for staging to pay back its fixed cost
    assert choose_path(few, threshold_bytes=4, min_fragments=1) == "staged"
    assert choose_path(Fragments.empty()) == "direct"


def test_staging_refuses_pieces_outside_the_model_and_mismatched_buffers():
    ctx = _layout()
    with pytest.raises(PlanError, match="layers outside the model's 0..4"):
        staging_pool(ctx, Piece(0, range(3, 6), range(0, 1)), 4096, 10)
    with pytest.raises(PlanError, match="kv heads outside the model's 0..5"):
        staging_nbytes(ctx, Piece(0, range(0, 1), range(5, 7)), 10)
    with pytest.raises(PlanError, match="at least one token"):
        staging_nbytes(ctx, Piece(0, range(0, 1), range(0, 1)), 0)
    a = staging_pool(ctx, Piece(0, range(0, 2), range(0, 1)), 4096, 10)
    b = staging_pool(ctx, Piece(0, range(0, 2), range(0, 1)), 8192, 11)
    with pytest.raises(PlanError, match="staging buffers differ"):
        staged_read(a, b)
