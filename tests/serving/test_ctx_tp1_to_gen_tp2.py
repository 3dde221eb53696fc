"""A context worker at TP1 and a generation worker at TP2 behind the router, KV moved by NIXL (UCX) between
real processes. on_transfer_failure: fail (the default): a failed transfer reaches the client as an error."""

from __future__ import annotations

import http.server
import json
import os
import threading

import httpx
import pytest

from .cluster import MODEL, PATIENT, PROMPTS, config, launch, sse_events, start_announced, stop_process, \
    streamed_tokens, wait_healthy, wait_pool_full
from .conftest import CHAT, MAX_TOKENS
from ..listeners import listening

BLOCKS = 64
CFG = {
    "model": MODEL,
    "executor": {"num_blocks": BLOCKS, "tokens_per_block": 8, "threads_per_rank": 1, "timeout_s": 120},
    "transceiver": {"agent": "nixl", "handshake_timeout_s": 3, **PATIENT},
    "router": {"port": 0, "policy": "round_robin", "request_timeout_s": 120},
    "context_servers": {"tp": 1},
    "generation_servers": {"tp": 2},
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = launch(CFG, str(tmp_path_factory.mktemp("logs")))
    yield c
    c.stop()


def test_ctx_tp1_to_gen_tp2_answers_exactly_the_aggregated_tokens(cluster, want):
    router = cluster.router_url + "/v1"
    for prompt, tokens in zip(PROMPTS, want["prompts"]):
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        r = httpx.post(router + "/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        kb = r.json()["kvbridge"]
        assert kb["token_ids"] == tokens and kb["recomputed"] is False
        assert kb["transfer"]["agents"] == ["nixl"] and kb["transfer"]["bytes"] > 0
    chat = {"messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0}
    r = httpx.post(router + "/chat/completions", json=chat, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion" and out["kvbridge"]["token_ids"] == want["chat"]
    assert out["choices"][0]["message"]["role"] == "assistant"
    with httpx.stream("POST", router + "/chat/completions", json={**chat, "stream": True}, timeout=120) as r:
        events = sse_events(r)
    assert streamed_tokens(events) == want["chat"] and events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == \
        out["choices"][0]["message"]["content"]
    assert wait_pool_full(cluster.cfg.context[0].url, BLOCKS, 1) == [BLOCKS]
    assert wait_pool_full(cluster.cfg.generation[0].url, BLOCKS, 2) == [BLOCKS] * 2


def test_a_failed_transfer_reaches_the_client_as_an_error_with_its_reason(cluster, tmp_path):
    """Fault: a context worker advertising its transceiver on 127.0.0.2, where nothing listens."""
    gen = cluster.cfg.generation[0].url
    bad = {**CFG, "transceiver": {**CFG["transceiver"], "advertise_host": "127.0.0.2", "pickup_timeout_s": 3},
           "context_servers": {"urls": ["127.0.0.1:0"]},
           "generation_servers": {"tp": 2, "urls": [gen.removeprefix("http://")]},
           "router": {"port": 0}}
    ctx, bad_ctx = start_announced(["worker", "--config", config(tmp_path, "bad", bad), "--role", "context"],
                                   str(tmp_path / "ctx.log"))
    router = None
    try:
        wait_healthy(bad_ctx, ctx)
        bad["context_servers"] = {"urls": [bad_ctx.removeprefix("http://")]}
        router, base = start_announced(["router", "--config", config(tmp_path, "bad-router", bad)],
                                       str(tmp_path / "router.log"))
        wait_healthy(base, router)
        url = base + "/v1/completions"
        for stream in (False, True):  # a stream fails before its first byte: a real HTTP error, not 200
            r = httpx.post(url, json={"prompt": PROMPTS[0], "max_tokens": 4, "stream": stream}, timeout=120)
            assert r.status_code == 502, r.text
            err = r.json()["error"]
            assert err["code"] == "kv_transfer_failed" and err["type"] == "server_error"
            assert err["message"].startswith("generation worker gen0: KV transfer from ctx0 failed")
            assert "127.0.0.2" in err["message"]
        assert wait_pool_full(bad_ctx, BLOCKS, 1, timeout=30) == [BLOCKS]
        assert wait_pool_full(gen, BLOCKS, 2) == [BLOCKS] * 2
    finally:
        if router is not None:
            stop_process(router)
        stop_process(ctx)


class _FailingWorker(http.server.BaseHTTPRequestHandler):
    """Fault injector: a 'context worker' that is healthy but fails every request with 503."""

    def do_GET(self):  # /health
        self._send(200, {"status": "ok"})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self._send(503, {"error": {"message": "injected failure", "type": "server_error",
                                   "code": "injected"}})

    def _send(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


def test_a_context_worker_that_fails_before_handing_over_is_retried_on_another(cluster, want, tmp_path):
    """ctx0 answers /health but fails requests with 503: the router retries on ctx1 and marks ctx0 down."""
    fake = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FailingWorker)
    threading.Thread(target=fake.serve_forever, daemon=True).start()
    cfg = {**CFG, "router": {"port": 0, "policy": "round_robin", "health_interval_s": 60},
           "context_servers": {"instances": 2, "urls": [f"127.0.0.1:{fake.server_port}",
                                                        cluster.cfg.context[0].url.removeprefix("http://")]},
           "generation_servers": {"tp": 2, "urls": [cluster.cfg.generation[0].url.removeprefix("http://")]}}
    try:
        router, base = start_announced(["router", "--config", config(tmp_path, "retry", cfg)],
                                       str(tmp_path / "router.log"))
    except BaseException:
        fake.shutdown()
        raise
    try:
        wait_healthy(base, router)
        for _ in range(2):
            r = httpx.post(base + "/v1/completions", timeout=120,
                           json={"prompt": PROMPTS[2], "max_tokens": MAX_TOKENS, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["kvbridge"]["token_ids"] == want["prompts"][2]
            assert r.json()["kvbridge"]["context_worker"] == "ctx1"
        assert "kvbridge_router_retries_total 1.0" in httpx.get(base + "/metrics").text  # ctx0 skipped after
        assert httpx.get(base + "/health").json()["context_workers"] == {"ctx0": False, "ctx1": True}
    finally:
        stop_process(router)
        fake.shutdown()


def test_nothing_of_a_one_host_deployment_listens_beyond_loopback(cluster):
    """The launcher confines UCX (and NCCL) to loopback when every KV peer is on this host (one_host_env):
    without it each NIXL agent's TCP transport listens on the host's network interfaces, unauthenticated."""
    groups = frozenset(os.getpgid(c.proc.pid) for c in cluster.children)
    addrs = listening(groups=groups)
    assert len({port for _, port in addrs}) >= 3  # the router, two workers, their agents and control planes
    assert all(ip.is_loopback for ip, _ in addrs), sorted(addrs)


def test_the_one_host_interfaces_yield_to_the_ones_the_environment_names():
    from kvbridge.serving.launcher import one_host_env

    assert one_host_env({}) == {"UCX_NET_DEVICES": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    mine = {"UCX_NET_DEVICES": "mlx5_0:1", "NCCL_SOCKET_IFNAME": "eth1"}
    assert one_host_env(dict(mine)) == mine
