"""The split matrix, in-process: every valid kind of ctx/gen split moves every byte; invalid ones say why.

Each valid cell runs `verify_split`: every rank's pool of both executors lives in one arena, context pools
hold codes of (layer, kv, head, token, dim), the real mapping and planner produce the descriptors, a memcpy
executes them, and every byte of every generation pool is compared (request tokens in place, the rest
untouched). See cells.py for the matrix and how large cells are sampled. Run with -s to see the counts.
"""

from __future__ import annotations

import collections

import pytest

from kvbridge.errors import LayoutError, LayoutMismatchError
from kvbridge.formatter.layout import KVLayout, KVShape, ParallelSplit
from kvbridge.formatter.mapping import mapping_for
from kvbridge.formatter.verify import verify_split

from .cells import DTYPES, HEADS, ORDERS, PPS, TPBS, TPS, all_cells, sample

CELLS = all_cells()
SAMPLE = sample(CELLS)
BY_TP = collections.defaultdict(list)
for _c in SAMPLE:
    BY_TP[(_c.ctx_tp, _c.gen_tp)].append(_c)


@pytest.mark.parametrize("tp_pair", sorted(BY_TP), ids=lambda p: f"ctxTP{p[0]}-genTP{p[1]}")
def test_every_sampled_valid_cell_moves_every_byte(tp_pair):
    failures = []
    for cell in BY_TP[tp_pair]:
        ctx, gen = cell.layouts()
        res = verify_split(ctx, gen, cell.variant()["tokens"], seed=cell.variant()["seed"])
        if not res.ok:
            failures.append(f"{cell.cli()}\n    {res.summary()}")
    assert not failures, f"{len(failures)} cells failed:\n" + "\n".join(failures)


def test_sample_keeps_every_kind_of_cell():
    kinds = {k for c in SAMPLE for k in c.kinds()}
    for c in CELLS:
        if c.valid:
            assert set(c.kinds()) <= kinds, f"no sampled cell of kind {set(c.kinds()) - kinds}"
    variants = [c.variant() for c in SAMPLE]
    assert {v["order"] for v in variants} == set(ORDERS)
    assert {v["dtype"] for v in variants} == set(DTYPES)
    for side in ("ctx", "gen"):
        for pp in PPS[1:]:
            assert any(v[f"{side}_layers"] and len(v[f"{side}_layers"]) == pp for v in variants), (side, pp)
    assert {c.heads for c in SAMPLE} == set(HEADS) and {c.tpb for c in SAMPLE} == set(TPBS)
    tokens = [v["tokens"] for v in variants]
    assert min(tokens) < 16 and max(tokens) > 2 * 64  # a partial first block and many blocks both occur
    valid = sum(c.valid for c in CELLS)
    small = sum(c.valid and c.small for c in CELLS)
    print(f"\nsplit matrix: {len(CELLS)} cells, {valid} valid ({small} small: all run; {valid - small} "
          f"large: {len(SAMPLE) - small} sampled), {len(CELLS) - valid} invalid (all checked); "
          f"{len(SAMPLE)} cells run")


def test_every_invalid_cell_is_refused_with_the_reason():
    n = 0
    for cell in CELLS:
        if cell.valid:
            continue
        with pytest.raises(LayoutError) as e:
            cell.layouts()
        heads = cell.heads
        bad_tp = cell.ctx_tp if heads % cell.ctx_tp and cell.ctx_tp % heads else cell.gen_tp
        msg = str(e.value)
        assert f"tp={bad_tp} cannot shard {heads} kv heads" in msg, msg
        assert "divide them" in msg and "multiple of them" in msg, msg
        n += 1
    assert n == sum(not c.valid for c in CELLS) > 0


def _layout(**kw) -> KVLayout:
    shape = dict(num_layers=7, num_kv_heads=2, head_dim=4, dtype="float16", tokens_per_block=16, mla=False)
    split = dict(tp=1, pp=1, layers_per_stage=None)
    for k in list(kw):
        if k in split:
            split[k] = kw.pop(k)
    order = kw.pop("order", "block_major")
    shape.update(kw)
    return KVLayout(KVShape(**shape), ParallelSplit(**split), order)


@pytest.mark.parametrize("field,ctx_kw,gen_kw", [
    ("head_dim", {}, {"head_dim": 8}),
    ("dtype", {}, {"dtype": "bfloat16"}),
    ("num_layers", {}, {"num_layers": 8}),
    ("num_kv_heads", {}, {"num_kv_heads": 1}),
    ("mla", {"num_kv_heads": 1}, {"num_kv_heads": 1, "mla": True}),
])
def test_incompatible_pair_is_refused_showing_both_layouts(field, ctx_kw, gen_kw):
    ctx, gen = _layout(**ctx_kw), _layout(**gen_kw)
    for fn in (lambda: mapping_for(ctx, gen), lambda: verify_split(ctx, gen, 20)):
        with pytest.raises(LayoutMismatchError) as e:
            fn()
        msg = str(e.value)
        assert f"disagree on {field}" in msg, msg
        assert ctx.describe() in msg and gen.describe() in msg


@pytest.mark.parametrize("kw,why", [
    ({"pp": 8}, "pp=8 exceeds the model's 7 layers"),
    ({"pp": 2, "layers_per_stage": (3, 3)}, "sums to 6, the model has 7 layers"),
    ({"pp": 3, "layers_per_stage": (3, 4)}, "has 2 entries but pp=3"),
    ({"pp": 2, "layers_per_stage": (7, 0)}, "at least one layer"),
    ({"tp": 3}, "tp=3 cannot shard 2 kv heads"),
    ({"num_kv_heads": 2, "mla": True}, "one latent 'head'"),
])
def test_a_split_no_engine_could_shard_says_why(kw, why):
    with pytest.raises(LayoutError) as e:
        _layout(**kw)
    assert why in str(e.value)


def test_ctx_tp3_to_gen_tp2_with_six_heads_straddles_ranks_byte_exact():
    ctx, gen = _layout(num_kv_heads=6, tp=3), _layout(num_kv_heads=6, tp=2, tokens_per_block=48)
    m = mapping_for(ctx, gen)
    assert [(p.ctx_rank, p.heads) for p in m.pieces(0)] == [(0, range(0, 2)), (1, range(2, 3))]
    assert [(p.ctx_rank, p.heads) for p in m.pieces(1)] == [(1, range(3, 4)), (2, range(4, 6))]
    assert verify_split(ctx, gen, 100).ok


def test_thirty_layers_split_8_8_7_7_to_pp3_byte_exact():
    ctx = _layout(num_layers=30, pp=4, layers_per_stage=(8, 8, 7, 7), num_kv_heads=3)
    gen = _layout(num_layers=30, pp=3, tp=3, num_kv_heads=3, tokens_per_block=48, order="layer_pools")
    m = mapping_for(ctx, gen)
    assert [(p.ctx_rank, p.layers) for p in m.pieces(0)] == [(0, range(0, 8)), (1, range(8, 10))]
    res = verify_split(ctx, gen, 77)
    assert res.ok, res.summary()


@pytest.mark.parametrize("tp", TPS)
def test_mla_reads_one_context_rank_per_pp_overlap(tp):
    ctx = _layout(num_kv_heads=1, mla=True, tp=tp, pp=2)
    gen = _layout(num_kv_heads=1, mla=True, tp=4, pp=3, tokens_per_block=48)
    m = mapping_for(ctx, gen)
    for g in range(gen.world_size):
        pieces = m.pieces(g)
        stages = [ctx.coords(p.ctx_rank)[1] for p in pieces]
        assert len(stages) == len(set(stages))  # one context rank per overlapping stage
    assert verify_split(ctx, gen, 40).ok
