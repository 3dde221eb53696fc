"""Sampling params on real rank processes: context-only (PP2: the sampler is not the leader) -> KV ->
generation-only gives exactly the aggregated tokens and logprobs with penalties, logit_bias and min_tokens."""

from __future__ import annotations

import pytest

from kvbridge.executor.runtime import Executor, ExecutorConfig
from kvbridge.executor.sampling import SamplingParams

PROMPT = [11, 42, 7, 7, 99, 3, 180, 64, 12, 5, 250]
PENALISED = dict(presence_penalty=0.8, frequency_penalty=1.2, repetition_penalty=1.7,
                 logit_bias=((17, 3.0), (42, -5.0)), min_tokens=4, logprobs=3)


def _cfg(**kw):
    base = dict(model="seeded:tiny", num_blocks=32, tokens_per_block=4, timeout_s=60)
    return ExecutorConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def agg():
    with Executor.start(_cfg()) as ex:
        yield ex


@pytest.fixture(scope="module")
def pair():
    with Executor.start(_cfg(pp=2)) as ctx, Executor.start(_cfg()) as gen:
        yield ctx, gen


def _stop_of(agg) -> tuple[int, ...]:
    """A stop id the penalised request would hit at once without min_tokens: its own first token."""
    sp = SamplingParams(**{**PENALISED, "min_tokens": 0})
    free = agg.wait(agg.submit(PROMPT, max_tokens=1, sampling=sp, stop_ids=()))
    return (free.tokens[0],)


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_context_pp2_then_generation_gives_the_aggregated_tokens_and_logprobs_with_penalties(agg, pair,
                                                                                            seeded):
    sp = SamplingParams(**PENALISED, **(dict(temperature=0.8, top_p=0.9, seed=77) if seeded else {}))
    stop = _stop_of(agg)
    plain = agg.generate([PROMPT], max_tokens=12)[0]
    want = agg.wait(agg.submit(PROMPT, max_tokens=12, sampling=sp, stop_ids=stop))
    assert want.tokens != plain and stop[0] not in want.tokens[:4]
    assert len(want.logprobs) == len(want.tokens)
    assert all(e.top and e.top[0][1] >= e.logprob for e in want.logprobs)
    ctx, gen = pair
    res = ctx.prefill(PROMPT, sampling=sp, stop_ids=stop)
    assert res.first_token == want.tokens[0] and res.first_logprob == want.logprobs[0]
    g = gen.add_generation(PROMPT, res.first_token, max_tokens=12, sampling=sp, stop_ids=stop)
    gen.write_kv(g.request_id, ctx.read_kv(res.request_id))
    ctx.release(res.request_id)
    gen.kv_ready(g.request_id)
    got = gen.wait(g.request_id)
    assert got.tokens == want.tokens and got.finish_reason == want.finish_reason
    assert got.logprobs == want.logprobs[1:]  # the first one was the context side's
    assert ctx.free_blocks() == [32, 32] and gen.free_blocks() == [32]


def test_streamed_logprobs_match_the_tokens_and_the_final_ones(agg):
    sp = SamplingParams(logprobs=2, logit_bias=((200, 100.0),))
    rid = agg.submit(PROMPT, max_tokens=6, sampling=sp, stream=True)
    have, seen, done = 0, [], None
    while done is None:
        toks, lps, done = agg.wait_stream(rid, have, timeout=30)
        assert len(lps) == len(toks)
        have, seen = len(toks), lps
    assert done.tokens == [200] * 6 and list(done.logprobs) == seen and len(seen) == 6
    assert agg.free_blocks() == [32]
