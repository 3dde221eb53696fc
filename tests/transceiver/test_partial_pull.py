"""Partial pulls (prefix reuse): the planner copies exactly tokens [first, n) for every split and block-size
pair, and a generation executor that holds a prompt's prefix pulls only the rest over real NIXL, with the
tokens of aggregated decoding."""

from __future__ import annotations


import numpy as np
import pytest

from kvbridge.errors import PlanError
from kvbridge.executor.runtime import Executor, ExecutorConfig
from kvbridge.executor.transceiver_hook import context_endpoints, disagg_params, hooked_executor_config
from kvbridge.formatter.layout import KVLayout, KVShape, ParallelSplit
from kvbridge.formatter.mapping import mapping_for
from kvbridge.formatter.planner import RankPool, plan_piece, plan_pieces
from kvbridge.formatter.staging import plan_pack, plan_unpack, staging_nbytes, staging_pool

NB = 12


def _apply(frags, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Run fragments on byte arrays; returns the mask of destination bytes written."""
    mask = np.zeros(dst.size, dtype=bool)
    for s, d, n in zip(frags.src.tolist(), frags.dst.tolist(), frags.length.tolist()):
        dst[d:d + n] = src[s:s + n]
        mask[d:d + n] = True
    return mask


@pytest.mark.parametrize("ctx_tp,gen_tp,tc,tg", [(2, 1, 4, 4), (1, 2, 8, 4), (2, 1, 4, 8), (1, 1, 6, 4)],
                         ids=["tp2to1_same_blocks", "tp1to2_blocks8to4", "tp2to1_blocks4to8", "blocks6to4"])
@pytest.mark.parametrize("first", [4, 8, 9])
def test_a_range_plan_copies_exactly_the_tokens_from_first_on(ctx_tp, gen_tp, tc, tg, first):
    ctx = KVLayout(KVShape(3, 2, 4, "float16", tc), ParallelSplit(ctx_tp, 1))
    gen = KVLayout(KVShape(3, 2, 4, "float16", tg), ParallelSplit(gen_tp, 1))
    n = 23
    rng = np.random.default_rng(first)
    cb, gb = rng.permutation(NB)[:-(-n // tc)], rng.permutation(NB)[:-(-n // tg)]
    for g in range(gen.world_size):
        size_g = NB * gen.block_bytes(g)
        gp = RankPool.of(gen, g, [0], NB)
        for piece in mapping_for(ctx, gen).pieces(g):
            cp = RankPool.of(ctx, piece.ctx_rank, [0], NB)
            src = (np.arange(NB * ctx.block_bytes(piece.ctx_rank)) * 7 + piece.ctx_rank).astype(np.uint8)
            full, part, head = (np.full(size_g, 0xEE, np.uint8) for _ in range(3))
            want = _apply(plan_piece(piece, cp, gp, cb, gb, n), src, full)
            got = _apply(plan_piece(piece, cp, gp, cb, gb, n, first), src, part)
            prefix = _apply(plan_piece(piece, cp, gp, cb, gb, first), src, head)
            assert np.array_equal(got, want & ~prefix)  # exactly the bytes of tokens [first, n)
            assert np.array_equal(part[got], full[got])
            assert (part[~got] == 0xEE).all()


@pytest.mark.parametrize("first", [0, 4, 9])
def test_a_staged_range_packs_and_unpacks_exactly_the_tokens_from_first_on(first):
    ctx = KVLayout(KVShape(3, 2, 4, "float16", 8), ParallelSplit(2, 1))
    gen = KVLayout(KVShape(3, 2, 4, "float16", 4))
    n = 23
    cb, gb = np.array([5, 1, 7]), np.array([2, 9, 0, 4, 11, 3])
    gp = RankPool.of(gen, 0, [0], NB)
    for piece in mapping_for(ctx, gen).pieces(0):
        cp = RankPool.of(ctx, piece.ctx_rank, [0], NB)
        src = (np.arange(NB * ctx.block_bytes(piece.ctx_rank)) * 13 + 1).astype(np.uint8)
        direct, staged = (np.full(NB * gen.block_bytes(0), 0xEE, np.uint8) for _ in range(2))
        want = _apply(plan_piece(piece, cp, gp, cb, gb, n, first), src, direct)
        slot = np.zeros(staging_nbytes(ctx, piece, n, first), np.uint8)
        stg = staging_pool(ctx, piece, 0, n, first_token=first)
        packed = _apply(plan_pack(piece, cp, stg, cb, n, first), src, slot)
        assert packed.all()  # the slot is exactly the range: every byte written once
        got = _apply(plan_unpack(piece, stg, gp, gb, n, first), slot, staged)
        assert np.array_equal(got, want) and np.array_equal(staged, direct)


def test_a_range_outside_the_request_is_refused():
    a = KVLayout(KVShape(2, 2, 4, "float16", 4))
    p = RankPool.of(a, 0, [0], NB)
    (piece,) = mapping_for(a, a).pieces(0)
    with pytest.raises(PlanError, match="first token 9 to copy is outside the request's 9 tokens"):
        plan_piece(piece, p, p, np.arange(3), np.arange(3), 9, 9)
    assert len(plan_pieces([piece], {0: p}, p, np.arange(3), np.arange(3), 9, 8)[0]) > 0


# --- real executors -----------------------------------------------------------------------------------
XCFG = {"agents": ["nixl"], "transfer_timeout_s": 30}
P1 = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]


STAGED = {**XCFG, "staging_arena_bytes": 4 << 20, "staging_min_fragments": 8}
VERIFY = {**XCFG, "verify": True}  # digests of exactly the range read, compared on the context side
HOST = {**STAGED, "staging_memory": "host"}  # every piece staged through host memory


def _exec(tmp_path, role, tag, xcfg, **kw) -> Executor:
    run_dir = tmp_path / tag
    run_dir.mkdir()
    return Executor.start(hooked_executor_config(role, f"{tag}-instance", run_dir, xcfg, model="seeded:tiny3",
                                                 timeout_s=90, enable_block_reuse=True, num_blocks=48, **kw))


def _disagg(ctx, gen, endpoints, prompt):
    res = ctx.prefill(prompt)
    params = disagg_params(ctx, res.request_id, endpoints).to_dict()
    rid = gen.submit(prompt, max_tokens=10, mode="generation_only", first_token=res.first_token,
                     ctx_info={"disagg_params": params})
    c = gen.wait(rid, timeout=60)
    assert c.finish_reason != "aborted", c.error
    return res, c


@pytest.mark.slow
@pytest.mark.parametrize("xcfg", [XCFG, STAGED, VERIFY, HOST], ids=["direct", "staged", "verify", "host_staged"])
def test_ctx_tp2_to_gen_tp1_with_other_block_sizes_pulls_only_the_missing_tokens(tmp_path, xcfg):
    with Executor.start(ExecutorConfig(model="seeded:tiny3", num_blocks=48, tokens_per_block=8)) as agg:
        want1 = agg.generate([P1], max_tokens=10)[0]
        p2 = P1 + want1 + [21, 22]
        want2 = agg.generate([p2], max_tokens=10)[0]
    with _exec(tmp_path, "context", "ctx", xcfg, tp=2, tokens_per_block=8) as ctx, \
            _exec(tmp_path, "generation", "gen", xcfg, tp=1, tokens_per_block=4) as gen:
        endpoints = context_endpoints(str(tmp_path / "ctx"), 2)
        per_token = gen.layout.block_bytes(0) // 4
        res1, c1 = _disagg(ctx, gen, endpoints, P1)
        assert c1.tokens == want1 and c1.reused_tokens == 0
        assert c1.transfer.as_json()["bytes"] == per_token * len(P1)
        res2, c2 = _disagg(ctx, gen, endpoints, p2)
        assert c2.tokens == want2
        assert res2.reused_tokens == 8  # the context side's cached 8-token block of P1
        # the generation side cached P1 + the 9 tokens it decoded: 22 tokens, 5 full blocks of 4
        assert c2.reused_tokens == 20
        stats = c2.transfer.as_json()
        assert stats["bytes"] == per_token * (len(p2) - 20)
        if xcfg in (STAGED, HOST):  # one packed read per context rank
            assert stats["fragments"] == 2 and c1.transfer.as_json()["fragments"] == 2
        for res in (res1, res2):  # the reader's Done releases the context side after the answer: wait for it
            ctx.wait_released(res.request_id, 30)
        assert ctx.free_blocks() == [48, 48]
        assert gen.free_blocks() == [48]


def test_fetch_carries_its_token_range_and_an_older_peers_fetch_means_all():
    from kvbridge import codec
    from kvbridge.transceiver import messages as m

    assert m.decode(m.Fetch(7, 1, False, False, 16).encode()).from_token == 16
    old = codec.pack({"v": m.PROTOCOL_VERSION, "t": "fetch", "ctx_request_id": 7, "gen_rank": 1})
    assert m.decode(old).from_token == 0
    with pytest.raises(m.ProtocolError, match="from_token"):
        m.decode(codec.pack({"v": m.PROTOCOL_VERSION, "t": "fetch", "ctx_request_id": 7, "gen_rank": 1,
                             "from_token": "16"}))
