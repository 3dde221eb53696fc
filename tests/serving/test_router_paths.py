"""The router's error paths, with real workers and a real router process; the fault is only where it happens:
a context worker that refuses connections (a port bound but not listening), one that accepts and never answers
(a listening socket nobody serves), generation rank processes stopped mid-stream (SIGSTOP). Each checks the
error the client gets (status, code, the text naming what failed), that it comes within a bound derived from
the config, and that every pool ends full.

    every context worker failed     502 context_failed naming each worker and why (refused; no answer in time)
    context hop past the deadline   504 timeout naming the silent worker
    streaming deadline              the stream ends with a timeout error event, no [DONE]; blocks come back
"""

from __future__ import annotations

import time

import httpx
import pytest

from .cluster import HEADERS, MODEL, PATIENT, PROMPTS, config, launch, start_announced, stop_process, \
    wait_pool_full
from .faults import dead_and_silent_ports, rank_processes, stopped

BLOCKS = 256
STREAM_DEADLINE_S = 8
CFG = {
    "model": MODEL,
    "executor": {"num_blocks": BLOCKS, "tokens_per_block": 16, "threads_per_rank": 1, "timeout_s": 120},
    "transceiver": {"agent": "tcp", **PATIENT},
    "router": {"port": 0, "request_timeout_s": STREAM_DEADLINE_S, "health_interval_s": 0.5},
    "context_servers": {"tp": 1},
    "generation_servers": {"tp": 1},
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = launch(CFG, str(tmp_path_factory.mktemp("logs")))
    yield c
    c.stop()


def _router(tmp_path, cluster, ctx_urls: list[str], **router):
    """A router of its own over `ctx_urls` and the cluster's generation worker, once it sees gen0 healthy."""
    gen = cluster.cfg.generation[0].url.removeprefix("http://")
    cfg = {**CFG, "router": {"port": 0, "health_interval_s": 0.5, **router},
           "context_servers": {"instances": len(ctx_urls), "urls": ctx_urls},
           "generation_servers": {"urls": [gen]}}
    proc, base = start_announced(["router", "--config", config(tmp_path, "router", cfg)],
                                 str(tmp_path / "router.log"))
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(base + "/health", timeout=5).json()["generation_workers"].get("gen0"):
                return proc, base
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            stop_process(proc)
            raise TimeoutError("the router never saw gen0 healthy")
        time.sleep(0.1)


def _post(base: str, **body) -> tuple[httpx.Response, float]:
    t0 = time.monotonic()
    r = httpx.post(base + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4, **body}, timeout=60)
    return r, time.monotonic() - t0


def _post_through_router(tmp_path, cluster, ctx_urls: list[str], **router) -> tuple[httpx.Response, float]:
    """One completion through a router of its own over `ctx_urls` (`_router`), stopped after: (answer, seconds)."""
    proc, base = _router(tmp_path, cluster, ctx_urls, **router)
    try:
        return _post(base)
    finally:
        stop_process(proc)


def _pools_full(cluster) -> None:
    assert wait_pool_full(cluster.cfg.context[0].url, BLOCKS, 1) == [BLOCKS]
    assert wait_pool_full(cluster.cfg.generation[0].url, BLOCKS, 1) == [BLOCKS]


def test_every_context_worker_failing_is_a_502_naming_each_and_why(cluster, tmp_path):
    hop_s = 1.0
    with dead_and_silent_ports() as (dead, silent):
        r, took = _post_through_router(tmp_path, cluster, [dead, silent], context_timeout_s=hop_s,
                                       request_timeout_s=60)
    assert r.status_code == 502, r.text
    err = r.json()["error"]
    assert err["code"] == "context_failed" and err["type"] == "server_error", err
    msg = err["message"]
    assert msg.startswith("no context worker could prefill the prompt: "), msg
    assert "ctx0: ConnectError" in msg, msg  # refused
    assert f"ctx1: no answer within {hop_s:.1f}s" in msg, msg  # silent: its hop timed out
    assert hop_s <= took < hop_s + 5, f"502 after {took:.1f} s"  # one silent hop, then nothing left to try
    _pools_full(cluster)  # nothing was prefilled anywhere


def test_a_context_hop_that_outlasts_the_request_deadline_is_a_504_naming_the_worker(cluster, tmp_path):
    deadline_s = 2.0
    with dead_and_silent_ports() as (_dead, silent):
        r, took = _post_through_router(tmp_path, cluster, [silent], context_timeout_s=30,
                                       request_timeout_s=deadline_s)
    assert r.status_code == 504, r.text
    err = r.json()["error"]
    assert err["code"] == "timeout", err
    want = "no context worker answered before the deadline (ctx0: no answer within "
    assert err["message"].startswith(want), err
    assert deadline_s - 0.5 <= took < deadline_s + 5, f"504 after {took:.1f} s"
    _pools_full(cluster)


def test_a_stream_past_the_deadline_ends_with_a_timeout_event_and_every_block_comes_back(cluster):
    gen_url = cluster.cfg.generation[0].url
    ranks = rank_processes(httpx.get(gen_url + "/health", headers=HEADERS, timeout=30).json()["pid"])
    assert len(ranks) == 1, ranks
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2000, "temperature": 0, "stream": True}
    events, t0 = [], time.monotonic()
    with httpx.stream("POST", cluster.router_url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:  # the first token event: the stream is running
            if line.startswith("data:"):
                events.append(line)
                break
        with stopped(ranks):  # no more tokens can come, however fast the box
            events += [line for line in lines if line.startswith("data:")]
            took = time.monotonic() - t0
    assert "[DONE]" not in events[-1] and '"error"' in events[-1], events[-3:]
    assert '"code": "timeout"' in events[-1] or '"code":"timeout"' in events[-1], events[-1]
    assert "did not finish" in events[-1], events[-1]  # the router's or the worker's deadline: the first
    assert STREAM_DEADLINE_S - 1 <= took < STREAM_DEADLINE_S + 5, f"ended after {took:.1f} s"
    deadline = time.monotonic() + 60
    while httpx.get(gen_url + "/health", headers=HEADERS, timeout=30).json()["in_flight"]:
        assert time.monotonic() < deadline, "the generation worker still has the request in flight after 60 s"
        time.sleep(0.2)
    _pools_full(cluster)
