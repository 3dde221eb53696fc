"""kv_aware over vLLM servers: a prompt's token ids (serving/vllm_tokens.py). Given ids are used as they are;
text and chats go to a healthy prefill server's /tokenize with what changes its tokenization; an answer that
is not a list of token ids, an error, or a server that does not answer routes the request least loaded
(None), never refuses it. The /tokenize here is an httpx MockTransport: fault injection
(tests/vllm/test_kv_aware_vllm.py asks real vLLM servers)."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import httpx
import pytest
from kvbridge.serving.balancer import Pool, WorkerRef
from kvbridge.serving.vllm_tokens import prompt_tokens


def _backend(handler) -> SimpleNamespace:
    w = WorkerRef("p-a", "http://127.0.0.1:9", "context", healthy=True)
    r = SimpleNamespace(client=httpx.AsyncClient(transport=httpx.MockTransport(handler)),
                        ctx=Pool([WorkerRef("p-x", "http://127.0.0.1:8", "context"), w], "kv_aware"),
                        cfg=SimpleNamespace(model_name="m"), rc=SimpleNamespace(connect_timeout_s=1.0))
    return SimpleNamespace(r=r, headers={"Authorization": "Bearer t"})


def _run(body: dict, handler) -> tuple[list[int] | None, list[dict]]:
    seen: list[dict] = []

    def h(req: httpx.Request) -> httpx.Response:
        seen.append({"url": str(req.url), "auth": req.headers.get("authorization"),
                     **json.loads(req.content)})
        return handler(req)

    async def go():
        b = _backend(h)
        try:
            return await prompt_tokens(b, body, time.monotonic() + 10)
        finally:
            await b.r.client.aclose()

    return asyncio.run(go()), seen


def test_given_ids_are_used_and_text_and_chats_go_to_a_healthy_servers_tokenize():
    assert _run({"prompt": [5, 6, 7]}, None) == ([5, 6, 7], [])
    assert _run({"prompt": [[5, 6]]}, None) == ([5, 6], [])
    ok = lambda _req: httpx.Response(200, json={"tokens": [1, 2, 3], "count": 3})  # noqa: E731
    got, seen = _run({"prompt": "hello", "add_special_tokens": False, "temperature": 0}, ok)
    assert got == [1, 2, 3] and seen == [{"url": "http://127.0.0.1:9/tokenize", "auth": "Bearer t",
                                          "prompt": "hello", "add_special_tokens": False, "model": "m"}]
    msgs = [{"role": "user", "content": "hi"}]
    got, seen = _run({"messages": msgs, "chat_template_kwargs": {"x": 1}, "max_tokens": 3}, ok)
    assert got == [1, 2, 3] and seen[0]["messages"] == msgs and seen[0]["chat_template_kwargs"] == {"x": 1}
    assert "max_tokens" not in seen[0]


@pytest.mark.parametrize("answer", [
    httpx.Response(500, text="boom"),
    httpx.Response(200, text="not json"),
    httpx.Response(200, json={"tokens": []}),
    httpx.Response(200, json={"tokens": [1, -2]}),
    httpx.Response(200, json={"tokens": "abc"}),
    httpx.Response(200, json={"tokens": [1, True]}),
    httpx.Response(200, json=[1, 2]),
])
def test_a_bad_tokenize_answer_routes_least_loaded(answer):
    assert _run({"prompt": "hello"}, lambda _req: answer)[0] is None


def test_a_tokenize_that_fails_to_connect_routes_least_loaded():
    def refuse(req):
        raise httpx.ConnectError("refused", request=req)

    assert _run({"prompt": "hello"}, refuse)[0] is None
    assert _run({"prompt": 5}, None) == (None, [])  # not a prompt it can tokenize: no call at all
