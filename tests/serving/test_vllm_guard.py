"""The guard in front of a vLLM server reached from other hosts (serving/vllm_guard.py), under faults.

tests/vllm/test_vllm_members.py runs it in front of real vLLM servers (join, streamed and plain traffic, the
drain, the routes vLLM leaves open refused). Here, what needs no vLLM: a server that is not there (fault
injection: a closed port behind the guard) and a body over the bound, on a real uvicorn and real sockets.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import uvicorn

from kvbridge.serving import vllm_guard
from kvbridge.serving.listen import bind
from kvbridge.serving.vllm_guard import GuardServer, guard_app

TOKEN = "t" * 32


@pytest.fixture()
def guard(monkeypatch):
    monkeypatch.setattr(vllm_guard, "MAX_BODY", 1 << 16)
    gone = bind("127.0.0.1", 0)
    port = gone.getsockname()[1]
    gone.close()  # nothing listens behind the guard: a vLLM server that died
    sock = bind("127.0.0.1", 0)
    server = GuardServer(uvicorn.Config(guard_app(f"http://127.0.0.1:{port}", TOKEN), log_level="warning",
                                        lifespan="on"))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the guard did not start"
        time.sleep(0.05)
    yield url
    server.should_exit = True
    t.join(10)


def test_the_guard_refuses_a_caller_without_the_token_on_every_route(guard):
    for method, path in (("POST", "/invocations"), ("POST", "/v1/completions"), ("GET", "/metrics"),
                         ("POST", "/tokenize"), ("POST", "/scale_elastic_ep"), ("GET", "/v1/models")):
        r = httpx.request(method, guard + path, json={}, headers={"Authorization": "Bearer anything"}, timeout=10)
        assert r.status_code == 401 and "X-KVBridge-Token" in r.text, (path, r.status_code)
    r = httpx.get(guard + "/health", timeout=10)  # the status alone, and the server behind is gone
    assert r.status_code == 503 and r.content == b""


def test_a_server_that_is_gone_or_a_body_over_the_bound_fail_by_name_and_the_guard_serves_on(guard):
    h = {"X-KVBridge-Token": TOKEN}
    r = httpx.post(guard + "/v1/completions", json={"prompt": "x"}, headers=h, timeout=20)
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unreachable"
    r = httpx.post(guard + "/v1/completions", content=b"x" * (1 << 17), headers=h, timeout=20)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert httpx.get(guard + "/health", headers=h, timeout=10).status_code == 502  # still answering, by name
