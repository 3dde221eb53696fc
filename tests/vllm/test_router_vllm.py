"""The router's vLLM hops (serving/vllm_backend.py) against fault-injecting stand-ins for vLLM's prefill and
decode servers, run by a real `kvbridge router` process over real HTTP: vLLM's proxy protocol as sent, and
vLLM's HTTP-200 error chunks turned into real errors. (Real vLLM servers: test_serve_vllm.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

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
        self.engine = False  # answer a prefill with KVBridgeConnector's engine fields (early decode)
        self.disconnected = 0  # early decodes whose caller went away while they waited
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
                if self.mode == "fail_early" and "kvbridge_early" in kvp:
                    return JSONResponse({"error": {"message": "engine died", "code": 500}}, status_code=500)
                out = {"handle": len(self.got), "secret": "s"}
                if self.engine:
                    out = {"do_remote_prefill": True, "kvbridge": {
                        "version": 1, "num_tokens": 5, "ctx_request_id": len(self.got), "secret": "ab" * 16,
                        "ctx_instance": "vllm-p", "endpoints": ["tcp://127.0.0.1:1"], "ctx_layout": {"x": 1},
                        "layout_fingerprint": "f", "packing": "vec"}}
                return {"id": "cmpl-p", "object": "text_completion", "model": body["model"],
                        "choices": [{"index": 0, "text": "a", "finish_reason": "length"}],
                        "kv_transfer_params": out}
            if (kvp.get("kvbridge") or {}).get("early") and self.mode == "fail_early":
                while not await request.is_disconnected():  # waits for KV that will never come
                    await asyncio.sleep(0.05)
                self.disconnected += 1
                return JSONResponse({}, status_code=499)
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
    try:
        with _router(tmp, [running["prefill"][2]], [running["decode"][2]], health_interval_s=0.2) as url:
            yield url, fakes["prefill"], fakes["decode"]
    finally:
        _stop(running.values())


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
                                         ({"n": 2, "best_of": 3}, "best_of"), ({"n": 0}, "n"),
                                         ({"n": 33, "prompt": ["a", "b"]}, "n")])
def test_what_this_path_cannot_do_is_refused_before_any_hop(fakes, body, param):
    url, p, d = fakes
    r = _post(url, {"prompt": "hello", "max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert p.got == [] and d.got == []


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_of_a_list_of_prompts_run_one_pair_of_hops_each_and_answer_as_one(fakes, stream):
    url, p, d = fakes
    body = {"prompt": ["a", "b"], "n": 2, "seed": 7, "max_tokens": 5, "stream": stream}
    if stream:
        with httpx.stream("POST", url + "/v1/completions", json={"model": "tiny-llama", **body}, timeout=60) as r:
            assert r.status_code == 200
            data = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
        indices = sorted({ch["index"] for x in data for ch in x["choices"]})
    else:
        r = _post(url, body)
        assert r.status_code == 200, r.text
        indices = [ch["index"] for ch in r.json()["choices"]]
        assert len(r.json()["kvbridge"]["choices"]) == 4
    assert indices == [0, 1, 2, 3]
    sent = sorted((x["prompt"], x["seed"]) for x in d.got)
    assert sent == [("a", 7), ("a", 8), ("b", 7), ("b", 8)], sent  # choice j of a prompt: seed + j
    assert len(p.got) == 4 and all("n" not in x and x["max_tokens"] == 1 for x in p.got)


def test_early_decode_sends_both_hops_once_the_engine_is_known_and_falls_back_when_the_prefill_fails(fakes):
    """KVBridgeConnector's engine fields in a prefill answer let the router send the next request's two hops
    together (the decode's params name the router's handle and secret, early); when that prefill then fails,
    the waiting decode is cancelled (its connection closed: vLLM aborts it) and the request runs the
    sequential way, answered normally."""
    url, p, d = fakes
    p.engine = True
    assert _post(url, {"prompt": "hello", "max_tokens": 5}).status_code == 200  # learns the engine
    assert "kvbridge_early" not in p.got[-1]["kv_transfer_params"]
    r = _post(url, {"prompt": "again", "max_tokens": 5})
    assert r.status_code == 200 and r.json()["kvbridge"]["early_decode"] is True, r.text
    early = p.got[-1]["kv_transfer_params"]["kvbridge_early"]
    kb = d.got[-1]["kv_transfer_params"]["kvbridge"]
    assert kb["early"] is True and (kb["ctx_request_id"], kb["secret"]) == (early["ctx_request_id"], early["secret"])
    assert kb["endpoints"] == ["tcp://127.0.0.1:1"] and kb["ctx_instance"] == "vllm-p" and "num_tokens" not in kb
    assert len(early["secret"]) == 32 and 0 < early["ctx_request_id"] < 1 << 63
    p.engine, p.mode, d.mode = False, "fail_early", "fail_early"  # the fallback's answer teaches no engine
    n_pre, n_dec = len(p.got), len(d.got)
    r = _post(url, {"prompt": "third", "max_tokens": 5})
    assert r.status_code == 200 and "early_decode" not in r.json()["kvbridge"], r.text
    assert len(p.got) == n_pre + 2 and len(d.got) == n_dec + 2  # the early pair, then the sequential pair
    assert "kvbridge_early" not in p.got[-1]["kv_transfer_params"]
    deadline = time.monotonic() + 10
    while d.disconnected < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert d.disconnected == 1, "the early decode was not cancelled"


class Dropper:
    """A decode server that is leaving: /health still answers, but a completion's connection is closed
    before any answer (what a server that dies or shuts down mid-request does to its caller)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port, self.dropped = self.sock.getsockname()[1], 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed: the test is over
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            data = b""
            while True:  # keep-alive: one request after another until a completion is dropped
                while b"\r\n\r\n" not in data:
                    got = conn.recv(65536)
                    if not got:
                        return
                    data += got
                head, _, data = data.partition(b"\r\n\r\n")
                if not head.startswith(b"GET /health"):
                    self.dropped += 1
                    return  # closed without an answer
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")


@contextlib.contextmanager
def _router(tmp_path, prefill_ports: list[int], decode_ports: list[int], **router):
    """A `kvbridge router` process (round robin; `router` keys over its defaults here) over stand-ins at these
    ports: its URL."""
    group = lambda ports: {"engine": "vllm", "instances": len(ports),  # noqa: E731
                           "urls": [f"127.0.0.1:{p}" for p in ports]}
    path = config(tmp_path, "vllm", {"model": "tiny-llama", "context_servers": group(prefill_ports),
                                     "generation_servers": group(decode_ports),
                                     "router": {"port": 0, "policy": "round_robin", "health_interval_s": 30,
                                                "request_timeout_s": 60, **router}})
    proc, url = start_announced(["router", "--config", path], str(tmp_path / "router.log"))
    try:
        wait_healthy(url, proc, 60)
        yield url
    finally:
        stop_process(proc)


def _stop(running) -> None:
    for server, t, _ in running:
        server.should_exit = True
        t.join(10)


def test_round_robin_takes_turns_over_prefill_and_decode_servers_whose_engine_is_not_known(tmp_path):
    """Two prefill and two decode servers answering like NixlConnector's (no engine: never early decode):
    four requests go two to each (a look at early decode takes no turn from the sequential run)."""
    fakes = [FakeVllm() for _ in range(4)]
    running = [_serve(f.app) for f in fakes]
    try:
        with _router(tmp_path, [r[2] for r in running[:2]], [r[2] for r in running[2:]]) as url:
            for i in range(4):
                assert _post(url, {"prompt": f"hello {i}", "max_tokens": 5}).status_code == 200
        assert [len(f.got) for f in fakes] == [2, 2, 2, 2]
    finally:
        _stop(running)


def test_a_decode_server_that_drops_the_connection_is_skipped_and_the_choice_runs_again(tmp_path):
    """Two decode servers, one of them closing every completion's connection unanswered: each request is
    answered (run again on the other decode server, the dropper marked down), none fails."""
    prefill, good, dropper = FakeVllm(), FakeVllm(), Dropper()
    running = [_serve(f.app) for f in (prefill, good)]
    try:
        with _router(tmp_path, [running[0][2]], [dropper.port, running[1][2]]) as url:
            for stream in (False, True, False, True):
                r = _post(url, {"prompt": "hello", "max_tokens": 5, "stream": stream})
                assert r.status_code == 200, r.text
        assert dropper.dropped >= 1 and len(good.got) == 4
        assert len(prefill.got) == 4 + dropper.dropped  # each dropped decode's choice was prefilled again
    finally:
        dropper.sock.close()
        _stop(running)
