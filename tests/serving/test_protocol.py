"""OpenAI request parsing (every bad field named), disaggregated_params checks, streamed text pieces."""

from __future__ import annotations

import pytest

from kvbridge.serving.protocol import ApiError, parse_disagg, parse_request
from kvbridge.serving.text import Detokenizer, TextCodec


@pytest.mark.parametrize("kind, body, param, text", [
    ("completion", [], None, "must be a JSON object"),
    ("completion", {}, "prompt", "prompt: expected a non-empty string"),
    ("completion", {"prompt": [1, -2]}, "prompt", "non-negative integers"),
    ("completion", {"prompt": [[1], [2]]}, "prompt", "one prompt per request"),
    ("completion", {"prompt": "x", "n": 2}, "n", "n=2 is not supported"),
    ("completion", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4 strings"),
    ("completion", {"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens: expected an integer in [1, "),
    ("completion", {"prompt": "x", "temperature": "hot"}, "temperature", "temperature: expected a number"),
    ("completion", {"prompt": "x", "stream": "yes"}, "stream", "stream: expected true or false"),
    ("chat", {"messages": []}, "messages", "messages: expected a non-empty list"),
    ("chat", {"messages": [{"role": "user"}]}, "messages", "messages[0]: expected"),
    ("completion", {"prompt": "x", "disaggregated_params": {"request_type": "both"}}, "disaggregated_params",
     "'both' is not 'context_only' or 'generation_only'"),
    ("completion", {"prompt": "x", "disaggregated_params": {"request_type": "generation_only",
                                                            "prompt_token_ids": [1], "first_token": 2}},
     "disaggregated_params", "ctx_params: expected the object a context worker returned"),
])
def test_a_bad_request_is_a_400_naming_the_field(kind, body, param, text):
    with pytest.raises(ApiError) as e:
        parse_request(body, kind, 16)
    assert e.value.status == 400 and e.value.param == param and text in e.value.message
    assert e.value.body()["error"]["type"] == "invalid_request_error"


def test_a_good_request_gets_openai_defaults():
    r = parse_request({"prompt": ["hello"], "max_completion_tokens": 5, "stream": True,
                       "stream_options": {"include_usage": True}, "logprobs": None, "n": 1}, "completion", 16)
    assert (r.prompt, r.max_tokens, r.temperature, r.top_p, r.seed, r.stream, r.include_usage) == \
        ("hello", 5, 1.0, 1.0, None, True, True)
    assert parse_request({"messages": [{"role": "user", "content": "hi"}]}, "chat", 99).max_tokens == 99
    d = parse_disagg({"request_type": "generation_only", "prompt_token_ids": [1, 2], "first_token": 3,
                      "ctx_params": {"x": 1}, "seed": 7, "context_worker": "ctx0"})
    assert parse_disagg(d.to_dict()) == d


def test_worker_errors_are_relayed_and_anything_else_becomes_a_named_server_error():
    e = ApiError.from_body(502, {"error": {"message": "KV transfer failed", "type": "server_error",
                                           "code": "kv_transfer_failed"}}, "generation worker gen0: ")
    assert (e.status, e.code) == (502, "kv_transfer_failed")
    assert e.message == "generation worker gen0: KV transfer failed"
    e = ApiError.from_body(200, "<html>", "ctx0: ")
    assert e.status == 502 and e.code == "bad_worker_response" and "ctx0: unexpected answer" in e.message


def test_a_body_too_large_or_not_json_is_refused_before_parsing():
    import asyncio

    class _Req:
        def __init__(self, chunks, length=None):
            self.headers = {} if length is None else {"content-length": str(length)}
            self._chunks = chunks

        async def stream(self):
            for c in self._chunks:
                yield c

    from kvbridge.serving.protocol import MAX_BODY_BYTES, read_json

    def run(req):
        try:
            return asyncio.run(read_json(req))
        except ApiError as e:
            return e.status, e.message

    assert run(_Req([b'{"a":', b" 1}"])) == {"a": 1}
    assert run(_Req([], MAX_BODY_BYTES + 1))[0] == 413
    assert run(_Req([b"x" * (1 << 20)] * 65))[0] == 413  # chunked, no length given
    assert run(_Req([b"{nope"]))[0] == 400


def test_streamed_text_never_splits_a_utf8_character():
    d = Detokenizer(TextCodec("seeded:tiny"))  # seeded models: token ids are UTF-8 bytes
    ids = list("né✓".encode())
    pieces = [d.delta(ids[:i + 1], final=i == len(ids) - 1) for i in range(len(ids))]
    assert "".join(pieces) == "né✓" and "\ufffd" not in "".join(pieces)
    assert pieces == ["n", "", "é", "", "", "✓"]
