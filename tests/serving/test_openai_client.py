"""The official `openai` client against the router of a live deployment (real processes, tcp agent): n=2
gives two choices, a list of prompts one choice each, message content as a list of text parts is accepted,
streams carry every choice, and a bad value is an `openai.BadRequestError` naming the field."""

from __future__ import annotations

import openai
import pytest

from kvbridge.serving.text import TextCodec

from .cluster import MODEL, PATIENT, PROMPTS, launch
from .conftest import CHAT, MAX_TOKENS

CFG = {
    "model": MODEL,
    "executor": {"num_blocks": 64, "tokens_per_block": 8, "threads_per_rank": 1, "timeout_s": 120},
    "transceiver": {"agent": "tcp", "handshake_timeout_s": 3, **PATIENT},
    "router": {"port": 0, "request_timeout_s": 120},
    "context_servers": {"tp": 1},
    "generation_servers": {"tp": 1},
}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    c = launch(CFG, str(tmp_path_factory.mktemp("logs")))
    try:
        with openai.OpenAI(base_url=c.router_url + "/v1", api_key="unused", timeout=120, max_retries=0) as oc:
            yield oc
    finally:
        c.stop()


@pytest.fixture(scope="module")
def text(want) -> dict:
    codec = TextCodec(MODEL)
    return {"prompts": [codec.decode(t) for t in want["prompts"]], "chat": codec.decode(want["chat"])}


def test_n_2_gives_two_choices_and_a_list_of_prompts_one_each(client, text):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], n=2, max_tokens=MAX_TOKENS, temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [text["prompts"][0]] * 2
    assert out.usage.prompt_tokens == len(PROMPTS[0]) and out.usage.completion_tokens == 2 * MAX_TOKENS
    out = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=MAX_TOKENS, temperature=0)
    assert [(c.index, c.text) for c in out.choices] == [(0, text["prompts"][0]), (1, text["prompts"][1])]


def test_message_content_as_text_parts_is_the_same_conversation(client, text):
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in CHAT]
    out = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].message.content == text["chat"]
    assert out.choices[0].finish_reason == "length"


def test_a_stream_of_two_choices_carries_both(client, text):
    got = {0: "", 1: ""}
    for ev in client.chat.completions.create(model=MODEL, messages=CHAT, n=2, max_tokens=MAX_TOKENS,
                                             temperature=0, stream=True):
        for c in ev.choices:
            got[c.index] += c.delta.content or ""
    assert got == {0: text["chat"], 1: text["chat"]}


@pytest.mark.parametrize("args, param", [
    ({"top_p": 0}, "top_p"), ({"temperature": -1}, "temperature"), ({"n": 0}, "n"),
    ({"seed": 2**64}, "seed"), ({"extra_body": {"best_of": 3}}, "best_of"),
    ({"extra_body": {"suffix": "x"}}, "suffix"),
])
def test_a_bad_value_is_a_bad_request_error_naming_the_field(client, args, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **args)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    assert e.value.body["param"] == "messages" and "image_url" in e.value.body["message"]
