"""The rank mapping over every valid TP/PP/kv-heads pair of the matrix (block sizes do not change it)."""

from __future__ import annotations

import collections
import itertools

import numpy as np
import pytest

from kvbridge.errors import LayoutError
from kvbridge.formatter.layout import KVLayout, KVShape, ParallelSplit
from kvbridge.formatter.mapping import mapping_for

from .cells import EXPLICIT, HEADS, NUM_LAYERS, PPS, TPS, shards


def _layout(tp, pp, heads, lps=None, tpb=16):
    mla = heads == "mla"
    shape = KVShape(NUM_LAYERS, 1 if mla else heads, 4, "float16", tpb, mla)
    return KVLayout(shape, ParallelSplit(tp, pp, lps))


def _pairs():
    for heads in HEADS:
        for c_tp, c_pp, g_tp, g_pp in itertools.product(TPS, PPS, TPS, PPS):
            if shards(c_tp, heads) and shards(g_tp, heads):
                # explicit uneven splits on the context side for odd cells, to cover both kinds cheaply
                lps = EXPLICIT[c_pp][-1] if (c_tp + g_tp + g_pp) % 2 else None
                yield _layout(c_tp, c_pp, heads, lps), _layout(g_tp, g_pp, heads)


PAIRS = list(_pairs())


def test_every_generation_rank_gets_each_layer_and_head_exactly_once():
    for ctx, gen in PAIRS:
        m = mapping_for(ctx, gen)
        heads = ctx.shape.num_kv_heads
        for g in range(gen.world_size):
            g_tp, g_pp = gen.coords(g)
            cover = np.zeros((NUM_LAYERS, heads), dtype=np.int64)
            seen_ctx = []
            for p in m.pieces(g):
                c_tp, c_pp = ctx.coords(p.ctx_rank)
                held_l, held_h = ctx.stage_layers(c_pp), ctx.head_range(c_tp)
                assert held_l.start <= p.layers.start and p.layers.stop <= held_l.stop, (p, ctx.describe())
                assert held_h.start <= p.heads.start and p.heads.stop <= held_h.stop, (p, ctx.describe())
                cover[p.layers.start:p.layers.stop, p.heads.start:p.heads.stop] += 1
                seen_ctx.append(p.ctx_rank)
            want = np.zeros_like(cover)
            ls, hs = gen.stage_layers(g_pp), gen.head_range(g_tp)
            want[ls.start:ls.stop, hs.start:hs.stop] = 1
            assert (cover == want).all(), f"{m.describe()}\n gen rank {g} coverage\n{cover}"
            assert len(seen_ctx) == len(set(seen_ctx)), f"two pieces from one context rank: {m.pieces(g)}"


def test_readers_of_agrees_with_pieces():
    for ctx, gen in PAIRS[::7]:
        m = mapping_for(ctx, gen)
        for c in range(ctx.world_size):
            assert m.readers_of(c) == tuple(g for g in range(gen.world_size) if c in m.ctx_ranks(g))


def test_duplicated_heads_spread_reads_evenly_over_their_replicas():
    checked = 0
    for ctx, gen in PAIRS:
        kvh, tp = ctx.shape.num_kv_heads, ctx.split.tp
        dup = tp if ctx.shape.mla else tp // kvh if tp >= kvh else 1
        if dup == 1 or ctx.split.tp == gen.split.tp:
            continue
        m = mapping_for(ctx, gen)
        loads = collections.Counter()  # (stage, head) -> reads per replica
        for g in range(gen.world_size):
            for p in m.pieces(g):
                c_tp, c_pp = ctx.coords(p.ctx_rank)
                for h in p.heads:
                    loads[(c_pp, h, c_tp)] += 1
        groups = collections.defaultdict(list)
        for (c_pp, h, c_tp), n in loads.items():
            groups[(c_pp, h)].append(n)
        for key, ns in groups.items():
            total = sum(ns)
            assert len(ns) == min(dup, total), (key, ns, m.describe())  # as many replicas as readers allow
            assert max(ns) - min(ns) <= 1, (key, ns, m.describe())
        checked += 1
    assert checked > 100


def test_strategy_names_the_kind_of_regrouping():
    a = _layout(2, 2, 8)
    assert mapping_for(a, _layout(2, 2, 8)).strategy == "identity"
    assert mapping_for(a, _layout(2, 2, 8, tpb=48)).strategy == "same_heads"
    assert mapping_for(a, _layout(2, 3, 8)).strategy == "same_heads"
    assert mapping_for(a, _layout(4, 1, 8)).strategy == "regrouped_heads"
    assert mapping_for(a, _layout(4, 1, 8)) is mapping_for(a, _layout(4, 1, 8))  # cached per layout pair


def test_identity_reads_each_rank_from_its_twin():
    a = _layout(3, 2, 6, (2, 5))
    m = mapping_for(a, a)
    for g in range(a.world_size):
        (p,) = m.pieces(g)
        assert p.ctx_rank == g


def test_mla_tp2_to_tp4_reads_each_latent_from_one_context_rank():
    m = mapping_for(_layout(2, 1, "mla"), _layout(4, 1, "mla"))
    assert [[(p.ctx_rank, p.layers, p.heads) for p in m.pieces(g)] for g in range(4)] == [
        [(r, range(0, NUM_LAYERS), range(0, 1))] for r in (0, 1, 0, 1)]


def test_out_of_range_ranks_are_named():
    m = mapping_for(_layout(2, 1, 8), _layout(4, 1, 8))
    with pytest.raises(LayoutError, match="generation rank 4 outside 0..3"):
        m.pieces(4)
    with pytest.raises(LayoutError, match="context rank 2 outside 0..1"):
        m.readers_of(2)
