"""The official `openai` client against the router of a live deployment (real processes, tcp agent): n=2
gives two choices, a list of prompts one choice each, message content as a list of text parts is accepted,
streams carry every choice, and a bad value is an `openai.BadRequestError` naming the field. Every answer's KV
passes the positional check (tests/serving/kvcheck.py): the generation worker holds the context worker's KV
byte for byte, position by position."""

from __future__ import annotations

import httpx
import openai
import pytest

from kvbridge.serving.text import TextCodec

from .cluster import HEADERS, MODEL, PROMPTS, exact_config, launch
from .conftest import CHAT, MAX_TOKENS
from .kvcheck import assert_kv_positional, handles_of, kv_digest

CFG = exact_config()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = launch(CFG, str(tmp_path_factory.mktemp("logs")))
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster):
    base = cluster.router_url + "/v1"
    with openai.OpenAI(base_url=base, api_key="unused", timeout=120, max_retries=0) as oc:
        yield oc


@pytest.fixture(scope="module")
def kv_check(cluster):
    """handles -> how many passed the positional KV check (each must be found on both workers)."""
    return lambda handles: assert_kv_positional(cluster.cfg.context[0].url, cluster.cfg.generation[0].url,
                                                handles)


def _handles(obj) -> list[int]:
    return handles_of(obj.model_extra["kvbridge"])


@pytest.fixture(scope="module")
def text(want) -> dict:
    codec = TextCodec(MODEL)
    return {"prompts": [codec.decode(t) for t in want["prompts"]], "chat": codec.decode(want["chat"])}


def test_n_2_gives_two_choices_and_a_list_of_prompts_one_each(client, text, kv_check):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], n=2, max_tokens=MAX_TOKENS, temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [text["prompts"][0]] * 2
    assert out.usage.prompt_tokens == len(PROMPTS[0]) and out.usage.completion_tokens == 2 * MAX_TOKENS
    handles = _handles(out)
    out = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=MAX_TOKENS, temperature=0)
    assert [(c.index, c.text) for c in out.choices] == [(0, text["prompts"][0]), (1, text["prompts"][1])]
    assert kv_check(handles + _handles(out)) == 4  # every choice crossed, and each one's KV is in place


def test_message_content_as_text_parts_is_the_same_conversation(client, text, kv_check):
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in CHAT]
    out = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].message.content == text["chat"]
    assert out.choices[0].finish_reason == "length"
    assert kv_check(_handles(out)) == 1


def test_a_stream_of_two_choices_carries_both(client, text, kv_check):
    got, handles = {0: "", 1: ""}, []
    for ev in client.chat.completions.create(model=MODEL, messages=CHAT, n=2, max_tokens=MAX_TOKENS,
                                             temperature=0, stream=True):
        for c in ev.choices:
            got[c.index] += c.delta.content or ""
        kb = ev.model_extra.get("kvbridge") or {}
        if "handle" in kb:  # each choice's last chunk names its request
            handles += handles_of(kb)
    assert got == {0: text["chat"], 1: text["chat"]}
    assert kv_check(handles) == 2


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


def test_kv_digests_need_the_token_name_a_bad_or_unknown_handle_and_answer_twice(cluster, client):
    ctx, gen = cluster.cfg.context[0].url, cluster.cfg.generation[0].url
    route = ctx + "/internal/kv_digests"
    assert httpx.get(route, params={"handle": "7"}, timeout=30).status_code == 401  # internal token required
    for bad in ["abc", "0", "-3", str(1 << 63), " 7", ""]:
        r = httpx.get(route, params={"handle": bad}, headers=HEADERS, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "handle", (bad, r.text)
    r = httpx.get(route, params={"handle": "12345"}, headers=HEADERS, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 404 and err["code"] == "unknown_handle", r.text
    assert "has no disaggregated request with handle 12345" in err["message"]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=2, temperature=0)
    (h,) = _handles(out)
    first = [kv_digest(u, h) for u in (ctx, gen)]
    assert [kv_digest(u, h) for u in (ctx, gen)] == first and first[0] == first[1]  # kept once taken
    assert first[0].num_tokens == len(PROMPTS[2])
