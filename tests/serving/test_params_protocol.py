"""Parsing of the token-level OpenAI parameters: ranges (a 400 naming the field), OpenAI's logprobs shapes,
and stop strings cut out of text, streamed pieces holding back a possible partial match."""

from __future__ import annotations

import pytest

from kvbridge.executor.sampling import TokenLogprob
from kvbridge.serving.protocol import ApiError, logprobs_object, parse_disagg, parse_request
from kvbridge.serving.stops import Piece, TextCutter
from kvbridge.serving.text import TextCodec

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("kind, extra, param, text", [
    ("completion", {"presence_penalty": 2.5}, "presence_penalty", "[-2.0, 2.0]"),
    ("completion", {"frequency_penalty": -3}, "frequency_penalty", "[-2.0, 2.0]"),
    ("completion", {"frequency_penalty": float("nan")}, "frequency_penalty", "nan"),
    ("completion", {"repetition_penalty": 0}, "repetition_penalty", "> 0"),
    ("completion", {"repetition_penalty": float("inf")}, "repetition_penalty", "> 0"),
    ("completion", {"logit_bias": {"12": 101}}, "logit_bias", "logit_bias[12]"),
    ("completion", {"logit_bias": {"x": 1}}, "logit_bias", "is not a token id"),
    ("completion", {"logit_bias": [1]}, "logit_bias", "expected an object"),
    ("completion", {"min_tokens": -1}, "min_tokens", "min_tokens"),
    ("completion", {"min_tokens": 9, "max_tokens": 4}, "min_tokens", "more than max_tokens"),
    ("completion", {"ignore_eos": 1}, "ignore_eos", "true or false"),
    ("completion", {"logprobs": 6}, "logprobs", "[0, 5]"),
    ("completion", {"logprobs": True}, "logprobs", "[0, 5]"),
    ("chat", {"logprobs": 1}, "logprobs", "true or false"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    ("chat", {"top_logprobs": 2}, "top_logprobs", "needs logprobs set to true"),
    ("completion", {"stop": 5}, "stop", "a string or a list"),
    ("completion", {"stop": ["a", 1]}, "stop", "a string or a list"),
])
def test_an_out_of_range_parameter_is_a_400_naming_it(kind, extra, param, text):
    body = {**({"prompt": "x"} if kind == "completion" else CHAT), **extra}
    with pytest.raises(ApiError) as e:
        parse_request(body, kind, 16)
    assert e.value.status == 400 and e.value.param == param and text in e.value.message


def test_the_parameters_parse_to_their_fields():
    r = parse_request({"prompt": "x", "presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.3,
                       "logit_bias": {"7": -100, "300": 2.5}, "min_tokens": 3, "ignore_eos": True, "logprobs": 2,
                       "stop": "\n"}, "completion", 16)
    assert (r.presence_penalty, r.frequency_penalty, r.repetition_penalty, r.logit_bias, r.min_tokens,
            r.ignore_eos, r.logprobs, r.stop) == (0.5, -1.0, 1.3, ((7, -100.0), (300, 2.5)), 3, True, 2, ("\n",))
    c = parse_request({**CHAT, "logprobs": True}, "chat", 16)
    assert (c.logprobs, c.stop) == (0, ())
    assert parse_request({**CHAT, "logprobs": True, "top_logprobs": 5, "stop": ["a", ""]}, "chat", 16).logprobs == 5
    assert parse_request({**CHAT, "logprobs": False, "presence_penalty": None}, "chat", 16).logprobs == -1
    assert parse_request({**CHAT, "top_logprobs": 0}, "chat", 16).logprobs == -1


def test_the_first_tokens_logprob_travels_in_disaggregated_params_and_is_checked():
    lp = TokenLogprob(-0.5, ((3, -0.5), (9, -1.25)))
    d = {"request_type": "generation_only", "prompt_token_ids": [1, 2], "first_token": 3, "ctx_params": {"x": 1},
         "first_logprob": lp.to_wire()}
    got = parse_disagg(d)
    assert got.first_logprob == lp and parse_disagg(got.to_dict()) == got
    with pytest.raises(ApiError, match="first_logprob"):
        parse_disagg({**d, "first_logprob": [float("nan"), []]})


def test_logprobs_objects_have_openais_shapes():
    entries = [TokenLogprob(-0.1, ((104, -0.1), (105, -2.0))), TokenLogprob(-1.0, ((33, -0.5),))]
    text_of = lambda t: (chr(t), [t])  # noqa: E731
    chat = logprobs_object("chat", [104, 105], entries, text_of)
    assert chat["content"][1] == {"token": "i", "logprob": -1.0, "bytes": [105],
                                  "top_logprobs": [{"token": "!", "logprob": -0.5, "bytes": [33]}]}
    comp = logprobs_object("completion", [104, 105], entries, text_of, offset=4)
    assert comp == {"tokens": ["h", "i"], "token_logprobs": [-0.1, -1.0],
                    "top_logprobs": [{"h": -0.1, "i": -2.0}, {"!": -0.5}], "text_offset": [4, 5]}


def test_stop_strings_cut_the_text_and_streaming_holds_back_a_possible_partial_match():
    codec = TextCodec("seeded:tiny3")  # raw bytes: one token per character
    ids = list(b"hello END world")
    cut = TextCutter(codec, ("END", "xyz"))
    pieces = []
    for n in range(1, len(ids) + 1):
        p = cut.update(ids[:n])
        pieces.append(p.text)
        if p.stopped_at is not None:
            break
    assert "".join(pieces) == "hello " and p.stopped_at == len("hello END")
    assert pieces[len("hello E") - 1] == ""  # "E" could start "END": held back
    # a partial match that turns out not to be one is released; the final piece gives everything
    cut = TextCutter(codec, ("END",))
    assert cut.update(list(b"an EN")).text == "an " and cut.update(list(b"an ENd")).text == "ENd"
    assert TextCutter(codec, ("END",)).update(list(b"xEN"), final=True).text == "xEN"
    # earliest match wins; a stop inside the very first token
    assert TextCutter(codec, ("b", "ab")).update(list(b"xab")) == Piece("x", 3)
    assert TextCutter(codec, ("x",)).update(list(b"xy")) == Piece("", 1)


def test_no_stop_string_counts_before_min_tokens():
    codec = TextCodec("seeded:tiny3")
    cut = TextCutter(codec, ("a",), min_tokens=3)
    assert cut.update(list(b"ba")) == Piece("ba")           # "a" within the first min_tokens: text, not a stop
    assert cut.update(list(b"bac")) == Piece("c")
    assert cut.update(list(b"baca")) == Piece("", 4)        # a match after min_tokens ends it
