"""Validation once at the router (strict JSON, depth, int64, ranges, unsupported fields named), the fan-out
of n / a list of prompts / echo, the admission bound, and a sampler that never dies on extreme values."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from kvbridge.executor.sampling import SamplingParams, sample
from kvbridge.serving.fanout import expand, expand_unread, merge
from kvbridge.serving.inflight import Admission, in_flight
from kvbridge.serving.protocol import ApiError, parse_request
from kvbridge.serving.validate import MAX_JSON_DEPTH, loads_strict


def _err(fn, *a) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(*a)
    return e.value


@pytest.mark.parametrize("raw, text", [
    (b'{"prompt": "x", "temperature": NaN}', "NaN is not a number JSON allows"),
    (b'{"prompt": "x", "top_p": Infinity}', "Infinity is not a number JSON allows"),
    (b'{"prompt": "x", "top_p": -Infinity}', "-Infinity is not a number JSON allows"),
    (b"[" * 5000 + b"]" * 5000, f"nests deeper than {MAX_JSON_DEPTH}"),
    (b'{"a": ' + b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1) + b"}", "nests deeper"),
    (b"{nope", "not JSON"),
])
def test_a_body_that_is_not_strict_bounded_json_is_a_400(raw, text):
    e = _err(loads_strict, raw)
    assert e.status == 400 and text in e.message


@pytest.mark.parametrize("raw, param, text", [
    (b'{"prompt": "x", "temperature": NaN}', "temperature", "temperature: NaN is not a number JSON allows"),
    (b'{"messages": [{"role": "user", "content": [1, -Infinity]}]}', "messages", "messages[0].content[1]: "),
    (b'{"prompt": "NaN", "top_p": Infinity}', "top_p", "top_p: Infinity"),
])
def test_nan_or_infinity_is_a_400_naming_the_field_that_holds_it(raw, param, text):
    e = _err(loads_strict, raw)
    assert e.status == 400 and e.param == param and text in e.message, e.message


@pytest.mark.parametrize("field, value, text", [
    ("seed", 2**64, "seed: expected an integer in [0, 9223372036854775807]"),
    ("top_k", 2**64, "top_k: expected an integer in [0, 9223372036854775807]"),
    ("max_tokens", 2**63, "max_tokens: expected an integer in [1, "),
    ("top_p", 0, "top_p: expected a number in (0, 1]"),
    ("top_p", 1.5, "top_p: expected a number in [0.0, 1.0]"),
    ("temperature", -0.1, "temperature: expected a number in [0.0, 100.0]"),
    ("best_of", 3, "best_of=3 is not supported"),
    ("suffix", "x", "suffix='x' is not supported"),
    ("tools", [{"type": "function"}], "tools="),
    ("response_format", {"type": "json_object"}, "response_format: only"),
    ("n", 0, "n: expected an integer in [1, 64]"),
    ("n", 2**64, "n: expected an integer in [1, 64]"),
])
def test_an_out_of_range_field_is_a_400_naming_it(field, value, text):
    e = _err(expand, {"prompt": "hi", field: value}, "completion", 16)
    assert e.status == 400 and e.param == field and text in e.message, e.message


def test_a_tiny_temperature_is_greedy():
    assert parse_request({"prompt": "x", "temperature": 1e-40}, "completion", 4).temperature == 0.0
    assert parse_request({"prompt": "x", "temperature": 0.5}, "completion", 4).temperature == 0.5


def test_the_sampler_never_fails_on_extreme_parameters():
    logits = torch.arange(32, dtype=torch.float32).reshape(2, 16) * 0.37
    greedy = logits.argmax(-1).tolist()
    for p in (SamplingParams(1e-40, 0, 1.0, 7), SamplingParams(1.0, 0, 0.0, 7),
              SamplingParams(0.7, 3, 1e-9, 7)):
        assert sample(logits, [p, p], [5, 6]) == greedy
    with pytest.raises(ValueError, match="temperature"):  # NaN never reaches the sampler: refused when built
        SamplingParams(float("nan"), 0, 1.0, 7)
    inf_row = torch.full((1, 16), float("inf"))
    assert sample(inf_row, [SamplingParams(1.0, 0, 1.0, 1)], [0]) == [0]


def test_chat_content_as_text_parts_is_joined_and_other_parts_are_refused():
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hello "},
                                                      {"type": "text", "text": "there"}]}]}
    (part,) = expand(body, "chat", 8)
    assert part.body["messages"] == [{"role": "user", "content": "Hello there"}]
    assert parse_request(body, "chat", 8).messages == [{"role": "user", "content": "Hello there"}]
    img = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    e = _err(expand, img, "chat", 8)
    assert e.status == 400 and e.param == "messages" and "'image_url'" in e.message


def test_n_and_a_list_of_prompts_fan_out_with_distinct_seeds_and_indexed_choices():
    parts = expand({"prompt": ["a b", "c"], "n": 2, "seed": 10, "echo": True}, "completion", 8)
    assert [(p.index, p.prompt_index, p.body["prompt"], p.body["seed"], p.echo) for p in parts] == [
        (0, 0, "a b", 10, "a b"), (1, 0, "a b", 11, "a b"), (2, 1, "c", 10, "c"), (3, 1, "c", 11, "c")]
    assert all("n" not in p.body and "echo" not in p.body for p in parts)
    answers = [{"choices": [{"index": 0, "text": f"t{i}", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 2 if i < 2 else 1, "completion_tokens": 3, "total_tokens": 0},
                "kvbridge": {"i": i}} for i in range(4)]
    out = merge(answers, parts)
    assert [(c["index"], c["text"]) for c in out["choices"]] == [(0, "a bt0"), (1, "a bt1"), (2, "ct2"),
                                                                 (3, "ct3")]
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 12, "total_tokens": 15}
    e = _err(expand, {"prompt": "x", "echo": True, "logprobs": 2}, "completion", 8)
    assert e.param == "echo" and "not supported" in e.message
    chat = {"messages": [{"role": "user", "content": "x"}], "echo": True}
    assert _err(expand, chat, "chat", 8).param == "echo"


def test_a_batch_of_one_prompt_is_that_prompt_on_either_path():
    (part,) = expand({"prompt": ["a b"], "echo": True}, "completion", 8)
    assert (part.body["prompt"], part.echo) == ("a b", "a b")
    (part,) = expand({"prompt": [[5, 6]]}, "completion", 8)
    assert part.body["prompt"] == [5, 6]
    (part,) = expand_unread({"prompt": ["a b"], "model": "x"}, "completion", "served")
    assert part.body == {"prompt": "a b", "model": "served"}
    (part,) = expand_unread({"prompt": [5, 6]}, "completion", "served")
    assert part.body["prompt"] == [5, 6]  # token ids are one prompt


def test_a_bad_field_in_any_prompt_of_a_list_is_refused_before_any_hop():
    e = _err(expand, {"prompt": ["ok", [1, -5]], "n": 1}, "completion", 8)
    assert e.status == 400 and e.param == "prompt"


def test_admission_bounds_requests_and_body_bytes_and_gives_them_back():
    a = Admission(max_requests=2, max_body_bytes=100)
    with a.request() as t1:
        t1(60)
        with a.request() as t2:
            e = _err(t2, 50)
            assert e.status == 503 and e.retry_after and e.headers() == {"Retry-After": "1"}
            with pytest.raises(ApiError) as full:
                with a.request():
                    pass
            assert full.value.status == 503 and "max_inflight_requests 2" in full.value.message
        assert (a.requests, a.body_bytes) == (1, 60)
    assert (a.requests, a.body_bytes) == (0, 0)


def test_in_flight_is_given_back_on_every_path():
    class W:
        in_flight = 0

    w = W()
    with pytest.raises(RuntimeError):
        with in_flight(w):
            assert w.in_flight == 1
            raise RuntimeError
    assert w.in_flight == 0


def test_read_json_counts_body_bytes_as_they_arrive():
    from kvbridge.serving.protocol import read_json

    class _Req:
        headers: dict = {}

        async def stream(self):
            for _ in range(10):
                yield b" " * 10
            raise AssertionError("read past the budget")

    seen = []

    def budget(n):
        seen.append(n)
        if sum(seen) > 30:
            raise ApiError(503, "busy")

    e = _err(lambda: asyncio.run(read_json(_Req(), budget)))
    assert e.status == 503 and sum(seen) == 40
    assert json.loads(b"{}") == {}


def test_a_generation_worker_is_picked_only_when_healthy():
    from kvbridge.serving.balancer import Pool, WorkerRef

    pool = Pool([WorkerRef("gen0", "http://a", "generation"), WorkerRef("gen1", "http://b", "generation")],
                "round_robin")
    assert pool.pick(healthy_only=True) is None and pool.pick().name == "gen0"  # unchecked: tried anyway
    pool.workers[1].mark(True)
    assert [pool.pick(healthy_only=True).name for _ in range(2)] == ["gen1", "gen1"]
