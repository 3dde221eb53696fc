"""The router's vLLM hops (serving/vllm_backend.py) against fault-injecting stand-ins for vLLM's prefill and
decode servers, run by a real `kvbridge router` process over real HTTP: vLLM's proxy protocol as sent, and
vLLM's HTTP-200 error chunks turned into real errors. (Real vLLM servers: test_serve_vllm.py.)"""

from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvbridge.serving.vllm_backend import MAX_HANDOVERS

from ..serving.cluster import TOKEN, config, start_announced, stop_process, wait_healthy


class FakeVllm:
    """One stand-in server: records what it got; `mode` says how its decode answers."""

    def __init__(self) -> None:
        self.got: list[dict] = []
        self.auth: list[str | None] = []
        self.mode = "ok"
        app = FastAPI()

        @app.get("/health")
        async def health():
            return {}

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            self.got.append(body)
            self.auth.append(request.headers.get("authorization"))
            kvp = body.get("kv_transfer_params") or {}
            if kvp.get("do_remote_decode"):
                return {"id": "cmpl-p", "object": "text_completion", "model": body["model"],
                        "choices": [{"index": 0, "text": "a", "finish_reason": "length"}],
                        "kv_transfer_params": {"handle": len(self.got), "secret": "s"}}
            if self.mode == "500" and not body.get("stream"):
                return JSONResponse({"error": {"message": "Internal server error", "code": 500}},
                                    status_code=500)
            if body.get("stream"):
                return StreamingResponse(self._events(body), media_type="text/event-stream")
            return {"id": "cmpl-d", "object": "text_completion", "model": body["model"],
                    "choices": [{"index": 0, "text": "abc", "finish_reason": "length"}],
                    "kv_transfer_params": {"kvbridge_transfer": {"bytes": 4096, "ms": 1.5, "error": ""}}}

        self.app = app

    async def _events(self, body):
        chunk = {"id": "cmpl-d", "object": "text_completion", "model": body["model"],
                 "choices": [{"index": 0, "text": "x", "finish_reason": None}]}
        err = {"error": {"message": "Internal server error", "code": 500}}  # what vLLM sends, with HTTP 200
        if self.mode == "error_first":
            yield f"data: {json.dumps(err)}\n\n"
        else:
            yield f"data: {json.dumps(chunk)}\n\n"
            yield f"data: {json.dumps(err if self.mode == 'error_mid' else chunk)}\n\n"
        yield "data: [DONE]\n\n"


def _serve(app) -> tuple[uvicorn.Server, threading.Thread, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    return server, t, sock.getsockname()[1]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router-vllm")
    fakes = {"prefill": FakeVllm(), "decode": FakeVllm()}
    running = {k: _serve(f.app) for k, f in fakes.items()}
    group = lambda k: {"engine": "vllm", "urls": [f"127.0.0.1:{running[k][2]}"]}  # noqa: E731
    path = config(tmp, "vllm", {"model": "tiny-llama", "context_servers": group("prefill"),
                                "generation_servers": group("decode"),
                                "router": {"port": 0, "health_interval_s": 0.2, "request_timeout_s": 60}})
    proc, url = start_announced(["router", "--config", path], str(tmp / "router.log"))
    try:
        wait_healthy(url, proc, 60)
        yield url, fakes["prefill"], fakes["decode"]
    finally:
        stop_process(proc)
        for server, t, _ in running.values():
            server.should_exit = True
            t.join(10)


@pytest.fixture
def fakes(deployment):
    url, p, d = deployment
    for f in (p, d):
        f.got.clear()
        f.auth.clear()
        f.mode = "ok"
    return url, p, d


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": "tiny-llama", **body}, timeout=60)


def test_the_prefill_asks_to_keep_the_kv_and_the_decode_gets_its_params_and_the_whole_request(fakes):
    url, p, d = fakes
    r = _post(url, {"prompt": "hello", "max_tokens": 5, "temperature": 0, "min_tokens": 2})
    assert r.status_code == 200, r.text
    pre, dec = p.got[0], d.got[0]
    assert pre["max_tokens"] == 1 and pre["stream"] is False and "min_tokens" not in pre
    assert pre["kv_transfer_params"]["do_remote_decode"] is True
    assert pre["kv_transfer_params"]["do_remote_prefill"] is False
    assert dec["max_tokens"] == 5 and dec["min_tokens"] == 2 and dec["prompt"] == "hello"
    assert dec["kv_transfer_params"] == {"handle": 1, "secret": "s"}  # passed on unread
    assert p.auth == d.auth == [f"Bearer {TOKEN}"]  # vLLM's /v1 is closed with the deployment's token
    out = r.json()
    assert out["choices"][0]["text"] == "abc" and "kv_transfer_params" not in out
    assert out["kvbridge"]["context_worker"] == "ctx0" and out["kvbridge"]["generation_worker"] == "gen0"
    assert out["kvbridge"]["transfer"] == {"bytes": 4096, "ms": 1.5, "error": ""}


@pytest.mark.parametrize("stream", [False, True])
def test_an_error_chunk_before_the_first_token_is_a_502_after_running_the_choice_again(fakes, stream):
    url, p, d = fakes
    d.mode = "error_first" if stream else "500"
    r = _post(url, {"prompt": "hello", "max_tokens": 5, "stream": stream})
    assert r.status_code == 502, r.text
    assert r.json()["error"]["code"] == "kv_transfer_failed"
    assert "Internal server error" in r.json()["error"]["message"]
    assert len(p.got) == len(d.got) == MAX_HANDOVERS


def test_an_error_chunk_after_the_first_token_ends_the_stream_with_an_error_event_and_no_done(fakes):
    url, _p, d = fakes
    d.mode = "error_mid"
    with httpx.stream("POST", url + "/v1/completions", timeout=60,
                      json={"model": "tiny-llama", "prompt": "hello", "max_tokens": 5, "stream": True}) as r:
        assert r.status_code == 200
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert json.loads(data[0])["choices"][0]["text"] == "x"
    assert "generation_failed" in data[-1] and "[DONE]" not in data


def test_a_stream_passes_through(fakes):
    url, _p, d = fakes
    with httpx.stream("POST", url + "/v1/completions", timeout=60,
                      json={"model": "tiny-llama", "prompt": "hello", "max_tokens": 5, "stream": True}) as r:
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert [json.loads(x)["choices"][0]["text"] for x in data[:-1]] == ["x", "x"] and data[-1] == "[DONE]"
    assert d.got[0]["stream"] is True


@pytest.mark.parametrize("body, param", [({"kv_transfer_params": {"handle": 1}}, "kv_transfer_params"),
                                         ({"n": 2}, "n"), ({"prompt": ["a", "b"]}, "prompt")])
def test_what_this_path_cannot_do_is_refused_before_any_hop(fakes, body, param):
    url, p, d = fakes
    r = _post(url, {"prompt": "hello", "max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert p.got == [] and d.got == []
