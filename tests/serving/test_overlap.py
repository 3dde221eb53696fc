"""Overlap in serving (docs/overlap.md): the generation worker is told of a request when its prefill starts,
and reads each layer group while the context worker's prefill is still computing the later layers.

Proven from the workers' own clocks (not sleeps): the generation rank's first KV read (the transfer's
`first_read_unix_ms`) is earlier than the end of the context's prefill step (`prefill_end_unix_ms`, taken
by the context leader when the step's forward and sampling ended), with exactly the aggregated tokens and
the positional KV check. The prefill is made long (a 1,536-token prompt through a 16-layer model) so the
hand-offs before the first read are a small part of it on any machine; layers are marked ready one by one.
"""

from __future__ import annotations

import httpx
import pytest

from kvbridge.executor.runtime import Executor, ExecutorConfig

from .cluster import PATIENT, launch, sse_events, streamed_tokens, wait_pool_full
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
