"""Token-level OpenAI parameters through the official `openai` client against a live deployment (a context and
a generation worker behind the router, KV moved by NIXL): penalties and logit_bias change the output and
disaggregated == aggregated tokens with them set; logprobs in OpenAI's shapes, consistent, and the same both
ways; stop strings end generation (streamed and not) without returning the stop text."""

from __future__ import annotations

import openai
import pytest

from .cluster import HEADERS, MODEL, PATIENT, PROMPTS, launch, wait_pool_full

BLOCKS = 64
CFG = {
    "model": MODEL,
    "executor": {"num_blocks": BLOCKS, "tokens_per_block": 8, "threads_per_rank": 1, "timeout_s": 120},
    "transceiver": {"agent": "nixl", "handshake_timeout_s": 3, **PATIENT},
    "router": {"port": 0, "policy": "round_robin", "request_timeout_s": 120},
    "context_servers": {"tp": 1},
    "generation_servers": {"tp": 1},
}
PENALTIES = dict(presence_penalty=0.7, frequency_penalty=1.1, logit_bias={"65": 4.0, "200": -50},
                 extra_body={"repetition_penalty": 1.6, "min_tokens": 3})


@pytest.fixture(scope="module")
def clients(tmp_path_factory):
    c = launch(CFG, str(tmp_path_factory.mktemp("logs")))
    mk = lambda url: openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120,  # noqa: E731
                                  default_headers=HEADERS)  # the aggregated client talks to a worker
    yield c, mk(c.router_url), mk(c.cfg.generation[0].url)  # disaggregated, aggregated (the gen worker alone)
    c.stop()


def _kb(resp) -> dict:
    return resp.model_extra["kvbridge"]


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_penalties_and_logit_bias_change_the_output_and_disaggregated_equals_aggregated(clients, seeded):
    c, disagg, agg = clients
    sampling = dict(temperature=0.9, top_p=0.95, seed=5) if seeded else dict(temperature=0)
    plain = agg.completions.create(model=c.cfg.model_name, prompt=PROMPTS[1], max_tokens=12, **sampling)
    got = {}
    for name, client in (("agg", agg), ("disagg", disagg)):
        got[name] = client.completions.create(model=c.cfg.model_name, prompt=PROMPTS[1], max_tokens=12,
                                              **sampling, **PENALTIES)
    assert _kb(got["disagg"])["token_ids"] == _kb(got["agg"])["token_ids"] != _kb(plain)["token_ids"]
    assert got["disagg"].choices[0].text == got["agg"].choices[0].text
    assert _kb(got["disagg"])["transfer"]["bytes"] > 0  # it really went through the KV transfer
    assert got["disagg"].usage.completion_tokens == 12


def test_logprobs_are_present_consistent_and_the_same_disaggregated(clients):
    c, disagg, agg = clients
    msgs = [{"role": "user", "content": "Why is the sky blue?"}]
    out = {}
    for name, client in (("agg", agg), ("disagg", disagg)):
        r = client.chat.completions.create(model=c.cfg.model_name, messages=msgs, max_tokens=8, temperature=0,
                                           logprobs=True, top_logprobs=3)
        out[name] = r
        content = r.choices[0].logprobs.content
        assert len(content) == r.usage.completion_tokens == 8
        for e in content:
            tops = [t.logprob for t in e.top_logprobs]
            assert len(tops) == 3 and tops == sorted(tops, reverse=True)
            assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob  # greedy
            assert e.logprob <= 0 and (e.bytes == list(e.token.encode()) or e.token.startswith("bytes:\\x"))
    a, d = (out[k].choices[0].logprobs.content for k in ("agg", "disagg"))
    assert [e.token for e in d] == [e.token for e in a]
    assert [e.logprob for e in d] == pytest.approx([e.logprob for e in a])
    # completions, streamed: every chunk carries its tokens' logprobs
    toks, lps, tops = [], [], []
    for ch in disagg.completions.create(model=c.cfg.model_name, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                        logprobs=2, stream=True):
        if ch.choices:
            toks += ch.model_extra["kvbridge"]["token_ids"]
            if ch.choices[0].logprobs is not None:
                lps += ch.choices[0].logprobs.token_logprobs
                tops += ch.choices[0].logprobs.top_logprobs
    assert len(toks) == len(lps) == len(tops) == 6
    assert all(len(t) <= 2 and max(t.values()) == pytest.approx(lp) for t, lp in zip(tops, lps))


def _stop_for(text: str) -> tuple[str, int]:
    """A stop string that occurs in `text` after its first character, and where it first starts."""
    for i, ch in enumerate(text[1:], 1):
        if ch.isprintable() and ch != "\ufffd" and text.index(ch) == i:
            return ch, i
    pytest.skip(f"no usable stop character in {text!r}")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_stop_string_ends_generation_and_is_not_returned(clients, stream):
    c, disagg, agg = clients
    full = agg.completions.create(model=c.cfg.model_name, prompt=PROMPTS[2], max_tokens=24, temperature=0)
    text = full.choices[0].text
    stop, at = _stop_for(text)
    kw = dict(model=c.cfg.model_name, prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=[stop, "\x00\x01"])
    if not stream:
        r = disagg.completions.create(**kw)
        got, finish, n = r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens
    else:
        got, finish, n = "", None, 0
        for ch in disagg.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
            if ch.choices:
                got += ch.choices[0].text
                assert stop not in got  # never sent, not even for a moment
                finish = ch.choices[0].finish_reason or finish
            if ch.usage:
                n = ch.usage.completion_tokens
    assert (got, finish) == (text[:at], "stop")
    assert 0 < n < 24 and full.model_extra["kvbridge"]["token_ids"][:n]  # usage counts the tokens generated
    assert wait_pool_full(c.cfg.generation[0].url, BLOCKS, 1) == [BLOCKS]  # ended early, its blocks freed
    assert wait_pool_full(c.cfg.context[0].url, BLOCKS, 1) == [BLOCKS]


def test_bad_values_are_400s_naming_the_parameter(clients):
    c, disagg, _ = clients
    for kw, param in ((dict(presence_penalty=3), "presence_penalty"), (dict(logit_bias={"999": 1}), "logit_bias"),
                      (dict(logprobs=9), "logprobs"), (dict(extra_body={"repetition_penalty": -1}),
                                                       "repetition_penalty")):
        with pytest.raises(openai.BadRequestError) as e:
            disagg.completions.create(model=c.cfg.model_name, prompt=PROMPTS[0], max_tokens=2, **kw)
        assert e.value.body["param"] == param, e.value.body


def test_requests_that_used_to_kill_a_worker_are_greedy_and_the_worker_keeps_serving(clients):
    """top_p=0 and temperature=1e-40 made the sampler raise (inf/nan probabilities) and the rank die. Sent to
    the worker itself: it refuses top_p=0 as the router does (a 400 naming it; the sampler would be greedy,
    tests/serving/test_validation.py), and a tiny temperature is greedy."""
    c, _, agg = clients
    want = agg.completions.create(model=c.cfg.model_name, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    with pytest.raises(openai.BadRequestError) as e:
        agg.completions.create(model=c.cfg.model_name, prompt=PROMPTS[0], max_tokens=4, seed=3, top_p=0.0)
    assert e.value.body["param"] == "top_p", e.value.body
    for kw in (dict(top_p=1e-30, temperature=1.0), dict(temperature=1e-40)):
        r = agg.completions.create(model=c.cfg.model_name, prompt=PROMPTS[0], max_tokens=4, seed=3, **kw)
        assert _kb(r)["token_ids"] == _kb(want)["token_ids"]


def test_streamed_chat_logprobs_come_with_their_chunks_and_equal_the_whole_answers(clients):
    c, disagg, _ = clients
    kw = dict(model=c.cfg.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0,
              logprobs=True, top_logprobs=2)
    whole = disagg.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = []
    for ch in disagg.chat.completions.create(**kw, stream=True):
        if ch.choices:
            lp = ch.choices[0].logprobs
            assert len(lp.content if lp else []) == len(ch.model_extra["kvbridge"]["token_ids"])
            streamed += lp.content if lp else []
    assert [(e.token, [t.token for t in e.top_logprobs]) for e in streamed] == \
        [(e.token, [t.token for t in e.top_logprobs]) for e in whole]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in whole])
