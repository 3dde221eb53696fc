"""The sampler on its own: penalties change logits exactly as specified, logit_bias, min_tokens bans,
logprobs, strict wire form, and requests that used to kill a rank (top_p=0, temperature=1e-40) sample greedily."""

from __future__ import annotations

import math

import pytest
import torch

from kvbridge.executor.engine import Engine, Request
from kvbridge.executor.sampling import SamplingParams, TokenHistory, TokenLogprob, process_logits, sample_step

LOGITS = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])


def _proc(p: SamplingParams, h: TokenHistory | None) -> list[float]:
    return process_logits(LOGITS, [p], [h])[0].tolist()


def test_frequency_and_presence_penalties_subtract_per_generated_occurrence():
    h = TokenHistory(prompt=(5,), output=(0, 0, 3, 1, 0))  # counts: 0 -> 3, 1 -> 1, 3 -> 1; prompt ignored
    got = _proc(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), h)
    want = [2.0 - 1.5 - 0.25, -1.0 - 0.5 - 0.25, 0.5, 3.0 - 0.5 - 0.25, -2.0, 1.0]
    assert got == pytest.approx(want)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_over_prompt_and_output():
    h = TokenHistory(prompt=(1, 5), output=(0,))
    got = _proc(SamplingParams(repetition_penalty=2.0), h)
    assert got == pytest.approx([1.0, -2.0, 0.5, 3.0, -2.0, 0.5])


def test_logit_bias_adds_and_forces_a_token_and_min_tokens_bans_the_stop_ids():
    p = SamplingParams(logit_bias=((4, 100.0), (3, -100.0)))
    assert _proc(p, None) == pytest.approx([2.0, -1.0, 0.5, -97.0, 98.0, 1.0])
    assert sample_step(LOGITS, [p], [0])[0] == [4]
    banned = _proc(SamplingParams(min_tokens=2), TokenHistory(banned=(3, 0)))
    assert banned[0] == banned[3] == -math.inf and banned[5] == 1.0
    assert sample_step(LOGITS, [SamplingParams(min_tokens=2)], [0], [TokenHistory(banned=(3,))])[0] == [0]


def test_rows_are_processed_independently_in_one_batch():
    x = LOGITS.repeat(3, 1)
    ps = [SamplingParams(), SamplingParams(frequency_penalty=2.0), SamplingParams(logit_bias=((1, 9.0),))]
    hs = [None, TokenHistory(output=(3, 3)), None]
    got = process_logits(x, ps, hs)
    assert got[0].tolist() == LOGITS[0].tolist()
    assert got[1, 3] == pytest.approx(-1.0) and got[2, 1] == pytest.approx(8.0)
    assert sample_step(x, ps, [0, 0, 0], hs)[0] == [3, 0, 1]


def test_top_p_zero_and_tiny_temperatures_are_greedy_and_never_raise():
    for p in (SamplingParams(temperature=1.0, top_p=0.0, seed=3), SamplingParams(temperature=1e-40, seed=3),
              SamplingParams(temperature=1.0, top_k=1, top_p=1e-12, seed=3)):
        assert sample_step(LOGITS, [p], [7])[0] == [3]
    allbanned = TokenHistory(banned=tuple(range(6)))
    toks, _ = sample_step(LOGITS, [SamplingParams(temperature=0.7, min_tokens=9)], [0], [allbanned])
    assert 0 <= toks[0] < 6  # nothing finite left: greedy fallback, not a crash


def test_logprobs_are_the_raw_distribution_sorted_and_the_chosen_token_matches_its_entry():
    p = SamplingParams(logprobs=3, logit_bias=((4, 100.0),))
    toks, lps = sample_step(LOGITS.repeat(2, 1), [p, SamplingParams()], [0, 0])
    raw = torch.log_softmax(LOGITS[0], -1)
    e = lps[0]
    assert toks[0] == 4 and lps[1] is None
    assert e.logprob == pytest.approx(float(raw[4]))
    assert [t for t, _ in e.top] == [3, 0, 5] and [v for _, v in e.top] == sorted((v for _, v in e.top),
                                                                                  reverse=True)
    assert dict(e.top)[3] == pytest.approx(float(raw[3]))
    assert TokenLogprob.from_wire(e.to_wire()) == e


@pytest.mark.parametrize("kw, field", [
    (dict(top_p=float("nan")), "top_p"), (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logit_bias=((1, 101.0),)), "logit_bias value"),
    (dict(logit_bias=((-1, 1.0),)), "logit_bias token id"),
    (dict(min_tokens=-1), "min_tokens"), (dict(logprobs=21), "logprobs"), (dict(seed=1 << 64), "seed"),
    (dict(top_k=True), "top_k"),
])
def test_bad_params_raise_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_the_wire_form_round_trips_and_is_strict():
    p = SamplingParams(0.5, 7, 0.9, 11, 0.1, -0.2, 1.3, ((5, -3.0),), 4, True, 2)
    assert SamplingParams.from_wire(p.to_wire()) == p
    for bad in ([0.5, 7, 0.9, 11], {**p.to_wire(), "v": 1}, {**p.to_wire(), "extra": 1},
                {**p.to_wire(), "ignore_eos": 1}, {**p.to_wire(), "top_k": 7.0}):
        with pytest.raises(ValueError):
            SamplingParams.from_wire(bad)


def test_the_engine_bans_stop_ids_until_min_tokens_and_ignore_eos_never_stops_on_them():
    eng = Engine(num_blocks=16, tokens_per_block=4, vocab_size=16)
    eng.submit(Request(1, [1, 2], 6, sampling=SamplingParams(min_tokens=2), stop_ids=(9,)))
    eng.submit(Request(2, [1, 2], 3, sampling=SamplingParams(ignore_eos=True), stop_ids=(9,)))
    eng.submit(Request(3, [1, 2], 3, sampling=SamplingParams(logit_bias=((16, 1.0),))))
    plan = eng.next_plan()
    assert [b.history for b in plan.batch] == [TokenHistory((), (), (9,)), None]
    events = eng.step_done(plan, [9, 9])
    assert type(events[0]).__name__ == "Refused" and "16" in events[0].msg
    plan = eng.next_plan()
    assert plan.batch[0].history == TokenHistory((), (), (9,))  # one token so far: still banned
    # (a real sampler could not pick 9 here; forced, the request has its 2 tokens and may stop)
    assert [(e.rid, e.reason) for e in eng.step_done(plan, [9, 9])] == [(1, "stop")]
    plan = eng.next_plan()
    assert plan.batch[0].history is None  # ignore_eos: nothing to ban
    done = eng.step_done(plan, [9])
    assert [(e.rid, e.reason, e.tokens) for e in done] == [(2, "length", [9] * 3)]


def test_packed_logprobs_travel_exactly_with_each_rows_own_width():
    from kvbridge.executor.sampling import logprob_width, pack_logprobs, unpack_logprobs

    ps = [SamplingParams(logprobs=2), SamplingParams(), SamplingParams(logprobs=0)]
    _, lps = sample_step(LOGITS.repeat(3, 1), ps, [0, 0, 0])
    k = logprob_width(ps)
    assert k == 2 and unpack_logprobs(pack_logprobs(lps, k), ps, k, 6) == lps
