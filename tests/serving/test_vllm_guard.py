"""The guard in front of a vLLM server reached from other hosts (serving/vllm_guard.py), under faults.

tests/vllm/test_vllm_members.py runs it in front of real vLLM servers (join, streamed and plain traffic, the
drain, the routes vLLM leaves open refused), and tests/vllm/test_kv_aware_vllm.py serving HTTPS (`tls:`). Here,
what needs no vLLM: a server that is not there (fault injection: a closed port behind the guard), a body over
the bound, and the guard as the TLS end, on a real uvicorn and real sockets.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import uvicorn

from kvbridge.serving import vllm_guard
from kvbridge.serving.listen import bind
from kvbridge.serving.vllm_guard import guard_server

TOKEN = "t" * 32


def _serve_guard(tls=None):
    """A guard (HTTPS with `tls`) in front of a closed port: (its url, server, thread), once it serves."""
    gone = bind("127.0.0.1", 0)
    port = gone.getsockname()[1]
    gone.close()  # nothing listens behind the guard: a vLLM server that died
    sock = bind("127.0.0.1", 0)
    server = guard_server(f"http://127.0.0.1:{port}", TOKEN, tls)
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    url = f"{'https' if tls else 'http'}://127.0.0.1:{sock.getsockname()[1]}"
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the guard did not start"
        time.sleep(0.05)
    return url, server, t


@pytest.fixture()
def guard(monkeypatch):
    monkeypatch.setattr(vllm_guard, "MAX_BODY", 1 << 16)
    url, server, t = _serve_guard()
    yield url
    server.should_exit = True
    t.join(10)


def test_the_guard_refuses_a_caller_without_the_token_on_every_route(guard):
    for method, path in (("POST", "/invocations"), ("POST", "/v1/completions"), ("GET", "/metrics"),
                         ("POST", "/tokenize"), ("POST", "/scale_elastic_ep"), ("GET", "/v1/models")):
        r = httpx.request(method, guard + path, json={}, headers={"Authorization": "Bearer x"}, timeout=10)
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


def test_with_tls_the_guard_serves_https_only_to_callers_that_trust_the_deployments_ca(tmp_path):
    """`tls:` with engine vllm: the guard is the TLS end (vLLM stays plain on loopback behind it)."""
    from kvbridge.serving.tls import parse_tls

    from .tls_certs import make_certs, openssl_missing

    if openssl_missing():
        pytest.skip(openssl_missing())
    certs = make_certs(str(tmp_path))
    url, server, t = _serve_guard(parse_tls(certs.tls()))
    try:
        h = {"X-KVBridge-Token": TOKEN}
        r = httpx.post(url + "/v1/completions", json={"prompt": "x"}, headers=h, verify=certs.trust(), timeout=20)
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unreachable"  # through TLS
        assert httpx.get(url + "/metrics", verify=certs.trust(), timeout=10).status_code == 401  # token still
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(url + "/health", headers=h, verify=certs.trust(certs.other_ca), timeout=10)
        with pytest.raises(httpx.HTTPError):
            httpx.get(url.replace("https://", "http://") + "/health", headers=h, timeout=10)
    finally:
        server.should_exit = True
        t.join(10)


def test_a_caller_that_goes_away_mid_stream_closes_the_servers_request(monkeypatch):
    """When the router (the guard's caller) drops a streamed answer, the guard closes its request to the
    server, which is how vLLM learns to abort it and free its blocks. The server here is fault injection: an
    answer that never ends, which notes when its caller went away."""
    left = threading.Event()

    async def endless(scope, receive, send):
        if scope["type"] != "http":
            return
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})

        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass
            left.set()

        import asyncio

        watcher = asyncio.create_task(watch())
        while not left.is_set():
            await send({"type": "http.response.body", "body": b"data: x\n\n", "more_body": True})
            await asyncio.sleep(0.02)
        watcher.cancel()

    up_sock = bind("127.0.0.1", 0)
    upstream = uvicorn.Server(uvicorn.Config(endless, log_level="warning", lifespan="off"))
    threading.Thread(target=upstream.run, kwargs={"sockets": [up_sock]}, daemon=True).start()
    g_sock = bind("127.0.0.1", 0)
    server = guard_server(f"http://127.0.0.1:{up_sock.getsockname()[1]}", TOKEN)
    t = threading.Thread(target=server.run, kwargs={"sockets": [g_sock]}, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 20
        while not (server.started and upstream.started):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        url = f"http://127.0.0.1:{g_sock.getsockname()[1]}/v1/completions"
        h = {"X-KVBridge-Token": TOKEN}
        with httpx.stream("POST", url, json={"stream": True}, headers=h, timeout=10) as r:
            assert r.status_code == 200
            chunks = r.iter_raw()
            next(chunks), next(chunks)  # the answer flows through the guard ...
        assert left.wait(10), "the guard kept the server's request open after its caller went away"
    finally:
        server.should_exit = upstream.should_exit = True
        t.join(10)
