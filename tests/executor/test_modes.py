"""Engine modes on real rank processes: context-only -> KV -> generation-only equals aggregated; continuous
batching; seeded sampling; refusals and misuse errors; every block back on the free list."""

from __future__ import annotations

import pytest

from kvbridge.errors import ExecutorError, KVCacheExhausted
from kvbridge.executor.runtime import Executor, ExecutorConfig
from kvbridge.executor.sampling import SamplingParams

PROMPT = [11, 42, 7, 7, 99, 3, 180, 64, 12, 5, 250]
SAMPLED = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=1234)


def _cfg(**kw):
    base = dict(model="seeded:tiny", num_blocks=32, tokens_per_block=4, timeout_s=60)
    base.update(kw)
    return ExecutorConfig(**base)


@pytest.fixture(scope="module")
def agg():
    with Executor.start(_cfg()) as ex:
        yield ex


@pytest.mark.parametrize("sampling", [None, SAMPLED], ids=["greedy", "seeded"])
def test_context_tp2_then_generation_pp2_gives_the_aggregated_tokens(agg, sampling):
    want = agg.generate([PROMPT], max_tokens=12, sampling=sampling)[0]
    with Executor.start(_cfg(tp=2)) as ctx, Executor.start(_cfg(pp=2)) as gen:
        res = ctx.prefill(PROMPT, sampling=sampling)
        assert res.num_tokens == len(PROMPT) and len(res.block_ids) == 3 and res.first_token == want[0]
        kv = ctx.read_kv(res.request_id)
        g = gen.add_generation(PROMPT, res.first_token, max_tokens=12, sampling=sampling)
        assert len(g.block_ids) == 3
        gen.write_kv(g.request_id, kv)
        torch_kv = gen.read_kv(g.request_id)
        assert (torch_kv == kv).all(), "the generation side holds exactly the KV written"
        ctx.release(res.request_id)
        gen.kv_ready(g.request_id)
        assert gen.wait(g.request_id).tokens == want
        assert ctx.free_blocks() == [32, 32] and gen.free_blocks() == [32, 32]


def test_requests_joining_mid_flight_decode_as_they_would_alone(agg):
    alone = [agg.generate([p], max_tokens=10)[0] for p in ([1, 2, 3], PROMPT, [9] * 9)]
    first = agg.submit([1, 2, 3], max_tokens=10)
    second = agg.submit(PROMPT, max_tokens=10)
    third = agg.submit([9] * 9, max_tokens=10)
    assert [agg.wait(r).tokens for r in (first, second, third)] == alone
    assert agg.free_blocks() == [32]


def test_seeded_sampling_is_reproducible_per_seed(agg):
    a = agg.generate([PROMPT], max_tokens=12, sampling=SAMPLED)[0]
    b = agg.generate([PROMPT, [1, 2]], max_tokens=12, sampling=SAMPLED)[0]
    c = agg.generate([PROMPT], max_tokens=12, sampling=SamplingParams(temperature=0.9, seed=99))[0]
    assert a == b
    assert a != c


def test_stop_tokens_end_a_request(agg):
    full = agg.generate([PROMPT], max_tokens=8)[0]
    got = agg.generate([PROMPT], max_tokens=8, stop_ids=(full[2],))[0]
    assert got == full[:full.index(full[2]) + 1]


def test_a_request_too_big_for_the_pool_is_refused_and_nothing_leaks(agg):
    with pytest.raises(KVCacheExhausted, match="needs 34 KV blocks to completion, the pool has only 32"):
        agg.generate([list(range(120))], max_tokens=16)
    # two requests that fit only one at a time: the second waits for the first's blocks
    big = list(range(60))
    assert len(agg.generate([big, big[::-1]], max_tokens=4)) == 2
    assert agg.free_blocks() == [32]


def test_misuse_raises_clear_errors_and_the_executor_keeps_serving(agg):
    with pytest.raises(ExecutorError, match="unknown request 987654"):
        agg.release(987654)
    res = agg.prefill(PROMPT)
    with pytest.raises(ExecutorError, match="not awaiting KV"):
        agg.kv_ready(res.request_id)
        agg.wait(res.request_id, timeout=10)
    agg.release(res.request_id)
    with pytest.raises(ExecutorError, match="unknown request"):
        agg.release(res.request_id)
    with pytest.raises(ExecutorError, match="token id 999 is outside the model's vocabulary 0..255"):
        agg.generate([[1, 999]], max_tokens=2)
    with pytest.raises(ExecutorError, match="unknown request 424242"):
        agg.read_kv(424242)
    import torch

    with pytest.raises(ExecutorError, match="unknown request 434343"):
        agg.write_kv(434343, torch.zeros(4, 2, 4, 3, 16))
        agg.wait(434343, timeout=10)
    g = agg.add_generation(PROMPT, 5, max_tokens=4)
    agg.abort(g.request_id)
    assert agg.wait(g.request_id).finish_reason == "aborted"
    assert agg.free_blocks() == [32]
    assert agg.generate([[1, 2, 3]], max_tokens=3)


def test_a_rank_that_cannot_start_fails_start_with_its_reason():
    with pytest.raises(ExecutorError, match="tp=3 does not divide the model's 8 attention heads"):
        Executor.start(_cfg(tp=3, timeout_s=120))  # the reason arrives as soon as a rank reports it: a
        # generous bound costs nothing, a tight one fails on a loaded box (it timed out at 30 s in a shuffled run)
