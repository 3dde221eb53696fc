"""Overlap in serving (docs/overlap.md): the generation worker is told of a request when its prefill starts,
and reads each layer group while the context worker's prefill is still computing the later layers.

Proven from the workers' own clocks (not sleeps): the generation rank's first KV read (the transfer's
`first_read_unix_ms`) is earlier than the end of the context's prefill step (`prefill_end_unix_ms`, taken
by the context leader when the step's forward and sampling ended), with exactly the aggregated tokens and
the positional KV check. The prefill is made long (a 1,536-token prompt through a 16-layer model) so the
hand-offs before the first read are a small part of it on any machine; layers are marked ready one by one.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from kvbridge.executor.runtime import Executor, ExecutorConfig

from .cluster import PATIENT, free_blocks, launch, sse_events, streamed_tokens, wait_pool_full
from .kvcheck import assert_kv_positional, handles_of

MODEL = "seeded:tiny3,layers=16,hidden=384,ffn=1024,seed=7"
PROMPT = [(i * 37 + 11) % 251 for i in range(1536)]
SHORT = [(i * 13 + 5) % 251 for i in range(40)]
MAX_TOKENS = 6
BLOCKS = 256
EXECUTOR = {"num_blocks": BLOCKS, "tokens_per_block": 16, "threads_per_rank": 1, "timeout_s": 300,
            "kv_digests": True}
CFG = {
    "model": MODEL,
    "executor": EXECUTOR,
    "transceiver": {"agent": "tcp", **PATIENT},
    "router": {"port": 0, "request_timeout_s": 300, "context_timeout_s": 300},
    "context_servers": {"tp": 1, "executor": {"stream_layers": 1}},
    # every prompt crosses whole (kvcheck.py: the positional check is exact for KV that crossed)
    "generation_servers": {"tp": 1, "executor": {"enable_block_reuse": False}},
}


@pytest.fixture(scope="module")
def want() -> list[list[int]]:
    cfg = ExecutorConfig(model=MODEL, num_blocks=BLOCKS, tokens_per_block=16, timeout_s=300)
    with Executor.start(cfg) as ex:
        return ex.generate([PROMPT, SHORT], max_tokens=MAX_TOKENS, timeout=300)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = launch(CFG, str(tmp_path_factory.mktemp("logs")))
    yield c
    c.stop()


def test_the_generation_worker_reads_kv_before_the_context_prefill_ends(cluster, want):
    r = httpx.post(cluster.router_url + "/v1/completions", timeout=300,
                   json={"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200, r.text
    kb = r.json()["kvbridge"]
    assert kb["token_ids"] == want[0] and kb["recomputed"] is False
    assert kb["overlap"] is True, kb  # the generation worker took the request at the handover
    start, end = kb["prefill_start_unix_ms"], kb["prefill_end_unix_ms"]
    first_read, decode = kb["transfer"]["ms"]["first_read_unix_ms"], kb["decode_start_unix_ms"]
    assert start < first_read < end, (f"first read {first_read - start:.1f} ms after the prefill started; "
                                      f"the prefill took {end - start:.1f} ms")
    assert decode >= end  # decoding needs the first token, sampled at the prefill's end
    assert_kv_positional(cluster.cfg.context[0].url, cluster.cfg.generation[0].url, handles_of(kb))
    assert wait_pool_full(cluster.cfg.context[0].url, BLOCKS, 1) == [BLOCKS]
    assert wait_pool_full(cluster.cfg.generation[0].url, BLOCKS, 1) == [BLOCKS]


def test_overlapped_streams_and_short_prompts_answer_exactly(cluster, want):
    url = cluster.router_url + "/v1/completions"
    body = {"prompt": SHORT, "max_tokens": MAX_TOKENS, "temperature": 0}
    r = httpx.post(url, json=body, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["kvbridge"]["token_ids"] == want[1]
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=300) as s:
        events = sse_events(s)
    assert streamed_tokens(events) == want[1] and events[-1] == "[DONE]"
    assert wait_pool_full(cluster.cfg.context[0].url, BLOCKS, 1) == [BLOCKS]
    assert wait_pool_full(cluster.cfg.generation[0].url, BLOCKS, 1) == [BLOCKS]


@pytest.fixture(scope="module")
def two_contexts(tmp_path_factory):
    cfg = {**CFG, "context_servers": {**CFG["context_servers"], "instances": 2},
           "router": {**CFG["router"], "policy": "round_robin", "health_interval_s": 0.5}}
    c = launch(cfg, str(tmp_path_factory.mktemp("logs2")))
    yield c
    c.stop()


def test_a_context_worker_killed_after_the_handover_costs_nothing(two_contexts, want):
    """kill -9 of the context worker while it prefills a request the generation worker already took (its
    blocks allocated for the prefetch): the router releases the prefetch, runs the request on the other
    context worker, and the answer is exact; the generation pool ends full."""
    c = two_contexts
    gen = c.cfg.generation[0].url
    box: dict = {}

    def ask():
        box["r"] = httpx.post(c.router_url + "/v1/completions", timeout=300,
                              json={"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0})

    t = threading.Thread(target=ask)
    t.start()
    try:
        deadline = time.monotonic() + 120
        while free_blocks(gen) == [BLOCKS]:  # the prefetch holds blocks once the handover reached gen0
            assert time.monotonic() < deadline and t.is_alive(), "the generation worker never took the request"
            time.sleep(0.05)
        busy = [w for w in c.cfg.context
                if httpx.get(w.url + "/health", headers=c.headers, timeout=10).json()["in_flight"]]
        assert len(busy) == 1
        victim = next(ch for ch in c.children if ch.url == busy[0].url)
        os.killpg(victim.proc.pid, signal.SIGKILL)
    finally:
        t.join(300)
    r = box["r"]
    assert r.status_code == 200, r.text
    kb = r.json()["kvbridge"]
    assert kb["token_ids"] == want[0] and kb["context_worker"] != victim.name
    assert wait_pool_full(gen, BLOCKS, 1) == [BLOCKS]
