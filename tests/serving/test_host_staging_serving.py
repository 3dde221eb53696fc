"""Staging through host memory in serving (docs/staging.md): with `transceiver.staging_memory: host` the
context worker packs each layer group into the reader's slot as the prefill marks it ready, the generation
worker reads and unpacks it meanwhile (router overlap), and the answer is exactly the aggregated one.

The same proof as test_overlap.py (the workers' own clocks, not sleeps): the first KV read is earlier than the
end of the context's prefill step, with the aggregated tokens, the positional KV check and every block back;
the transfer's few fragments (one per packed layer range) show it went staged.
"""

from __future__ import annotations

import httpx
import pytest

from kvbridge.executor.runtime import Executor, ExecutorConfig

from .cluster import PATIENT, launch, wait_pool_full
from .kvcheck import assert_kv_positional, handles_of
from .test_overlap import BLOCKS, EXECUTOR, MAX_TOKENS, MODEL, PROMPT

CFG = {
    "model": MODEL,
    "executor": EXECUTOR,
    "transceiver": {"agent": "tcp", "staging_arena_bytes": 64 << 20, "staging_memory": "host", **PATIENT},
    "router": {"port": 0, "request_timeout_s": 300, "context_timeout_s": 300},
    "context_servers": {"tp": 1},  # serving's default layer-wise streaming stays on with host staging
    "generation_servers": {"tp": 1, "executor": {"enable_block_reuse": False}},
}


@pytest.fixture(scope="module")
def want() -> list[int]:
    cfg = ExecutorConfig(model=MODEL, num_blocks=BLOCKS, tokens_per_block=16, timeout_s=300)
    with Executor.start(cfg) as ex:
        return ex.generate([PROMPT], max_tokens=MAX_TOKENS, timeout=300)[0]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = launch(CFG, str(tmp_path_factory.mktemp("logs")))
    yield c
    c.stop()


def test_host_staged_layers_are_read_while_the_prefill_runs_and_answer_exactly(cluster, want):
    r = httpx.post(cluster.router_url + "/v1/completions", timeout=300,
                   json={"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200, r.text
    kb = r.json()["kvbridge"]
    assert kb["token_ids"] == want and kb["recomputed"] is False
    assert kb["overlap"] is True, kb
    start, end = kb["prefill_start_unix_ms"], kb["prefill_end_unix_ms"]
    first_read = kb["transfer"]["ms"]["first_read_unix_ms"]
    assert start < first_read < end, (f"first read {first_read - start:.1f} ms after the prefill started; "
                                      f"the prefill took {end - start:.1f} ms")
    # staged: one read per packed layer range (16 layers marked ready in groups), direct would be thousands
    assert 1 <= kb["transfer"]["fragments"] <= 16, kb["transfer"]
    assert_kv_positional(cluster.cfg.context[0].url, cluster.cfg.generation[0].url, handles_of(kb))
    assert wait_pool_full(cluster.cfg.context[0].url, BLOCKS, 1) == [BLOCKS]
    assert wait_pool_full(cluster.cfg.generation[0].url, BLOCKS, 1) == [BLOCKS]
