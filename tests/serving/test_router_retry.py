"""Retry after handover: two context workers (separate processes) and one generation worker behind the
router; kill -9 of one context worker (its whole process group) with requests in flight costs no request:
those caught mid-prefill are retried on the other context worker, those caught mid-transfer are run again
from it (the generation worker's failed KV pull comes back as kv_transfer_failed), all with exact tokens.
A SIGSTOP'd context worker costs no request either, and nothing waits past its deadline."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from .cluster import MODEL, PROMPTS, launch, wait_pool_full
from .conftest import MAX_TOKENS

BLOCKS = 128
CFG = {
    "model": MODEL,
    "executor": {"num_blocks": BLOCKS, "tokens_per_block": 8, "threads_per_rank": 1, "timeout_s": 120},
    "transceiver": {"agent": "tcp", "handshake_timeout_s": 3, "transfer_timeout_s": 30, "peer_timeout_s": 5,
                    "lease_s": 30, "heartbeat_s": 0.5},
    "router": {"port": 0, "policy": "round_robin", "request_timeout_s": 120, "health_interval_s": 0.5,
               "context_timeout_s": 10},
    "context_servers": {"instances": 2, "tp": 1},
    "generation_servers": {"tp": 1},
}
REQUESTS = 48


@pytest.fixture
def cluster(tmp_path):
    c = launch(CFG, str(tmp_path))
    yield c
    c.stop()


def _burst(url: str, n: int, on_first_answer) -> tuple[int, list[httpx.Response]]:
    """n concurrent greedy requests; `on_first_answer()` runs once the first is answered (the rest are in
    flight then). Returns how many were answered by the time it ran, and every response in order."""
    answered = threading.Semaphore(0)

    def one(i: int):
        body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": MAX_TOKENS, "temperature": 0}
        try:
            return httpx.post(url, json=body, timeout=180)
        finally:
            answered.release()

    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(one, i) for i in range(n)]
        assert answered.acquire(timeout=120)  # the first answer: the rest are in flight now
        on_first_answer()
        done_before = sum(f.done() for f in futures)
        return done_before, [f.result() for f in futures]


@pytest.mark.slow
def test_kill_9_of_a_context_worker_with_requests_in_flight_loses_none(cluster, want):
    url = cluster.router_url + "/v1/completions"
    ctx0 = next(c for c in cluster.children if c.name == "ctx0")
    done_before_kill, results = _burst(url, REQUESTS, lambda: os.killpg(ctx0.proc.pid, signal.SIGKILL))
    assert done_before_kill < REQUESTS
    bad = [(r.status_code, r.text[:300]) for r in results if r.status_code != 200]
    assert not bad, bad
    for i, r in enumerate(results):
        assert r.json()["kvbridge"]["token_ids"] == want["prompts"][i % len(PROMPTS)]
    after = [r.json()["kvbridge"]["context_worker"] for r in results[done_before_kill + 4:]]
    assert set(after) <= {"ctx0", "ctx1"} and "ctx1" in after
    assert wait_pool_full(cluster.cfg.context[1].url, BLOCKS, 1) == [BLOCKS]
    assert wait_pool_full(cluster.cfg.generation[0].url, BLOCKS, 1) == [BLOCKS]
    r = httpx.post(url, json={"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["kvbridge"]["context_worker"] == "ctx1"
    metrics = httpx.get(cluster.router_url + "/metrics", timeout=10).text
    retries = re.findall(r"^kvbridge_router_retries_total (\S+)", metrics, re.M)
    print(f"killed ctx0 with {REQUESTS - done_before_kill} of {REQUESTS} in flight; router retries: {retries}")


@pytest.mark.slow
def test_a_sigstopped_context_worker_costs_no_request_and_nothing_waits_past_its_deadline(cluster, want):
    """SIGSTOP: ctx0 answers nothing (no reset either). Its context hops time out (context_timeout_s 10) and
    go to ctx1; pulls from it fail once its heartbeats stop (peer_timeout_s 5) and are run again."""
    url = cluster.router_url + "/v1/completions"
    ctx0 = next(c for c in cluster.children if c.name == "ctx0")
    t0 = time.monotonic()
    try:
        _, results = _burst(url, 16, lambda: os.killpg(ctx0.proc.pid, signal.SIGSTOP))
        took = time.monotonic() - t0
    finally:
        os.killpg(ctx0.proc.pid, signal.SIGCONT)
    bad = [(r.status_code, r.text[:300]) for r in results if r.status_code != 200]
    assert not bad, bad
    for i, r in enumerate(results):
        assert r.json()["kvbridge"]["token_ids"] == want["prompts"][i % len(PROMPTS)]
    assert took < CFG["router"]["request_timeout_s"]
    assert wait_pool_full(cluster.cfg.generation[0].url, BLOCKS, 1) == [BLOCKS]


@pytest.mark.slow
def test_kill_9_of_a_generation_worker_with_requests_in_flight_loses_none(tmp_path, want):
    """Two generation workers; kill -9 of one with requests in flight (mid-pull or mid-decode: a request that is
    not streamed is answered only at its end, so nothing reached its client yet). Each is run again from the
    context worker on the other generation worker (its prefill's KV released), with exact tokens; the
    survivor's and the context worker's pools end full."""
    cfg = {**CFG, "context_servers": {"instances": 1, "tp": 1}, "generation_servers": {"instances": 2, "tp": 1}}
    c = launch(cfg, str(tmp_path))
    try:
        url = c.router_url + "/v1/completions"
        gen0 = next(ch for ch in c.children if ch.name == "gen0")
        done_before_kill, results = _burst(url, 32, lambda: os.killpg(gen0.proc.pid, signal.SIGKILL))
        assert done_before_kill < 32
        bad = [(r.status_code, r.text[:300]) for r in results if r.status_code != 200]
        assert not bad, bad
        for i, r in enumerate(results):
            assert r.json()["kvbridge"]["token_ids"] == want["prompts"][i % len(PROMPTS)]
        assert "gen1" in {r.json()["kvbridge"]["generation_worker"] for r in results[done_before_kill:]}
        assert wait_pool_full(c.cfg.context[0].url, BLOCKS, 1) == [BLOCKS]
        assert wait_pool_full(c.cfg.generation[1].url, BLOCKS, 1) == [BLOCKS]
        retries = re.findall(r"^kvbridge_router_retries_total (\S+)", httpx.get(c.router_url + "/metrics",
                                                                                 timeout=10).text, re.M)
        print(f"killed gen0 with {32 - done_before_kill} of 32 in flight; router reruns: {retries}")
    finally:
        c.stop()
