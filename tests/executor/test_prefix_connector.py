"""The persistent KV connector and block reuse together: a connector load fills blocks that the prefix tree
then serves to the next request with that prefix (no second load), with the tokens of a fresh prefill."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvbridge.executor.connector import KvConnectorConfig
from kvbridge.executor.runtime import Executor, ExecutorConfig

TPB = 16
BLOCKS = 64


def _prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


P = _prompt(4 * TPB + 5, 11)
P2 = P[:4 * TPB] + _prompt(9, 12)  # the same 4 full blocks, another tail


def _cfg(store=None, reuse=False):
    conn = KvConnectorConfig.persistent(str(store)) if store is not None else None
    return ExecutorConfig(model="seeded:tiny", num_blocks=BLOCKS, tokens_per_block=TPB, timeout_s=60,
                          kv_connector_config=conn, enable_block_reuse=reuse)


def _settle(ex, timeout=30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        free = ex.free_blocks()
        if all(f == BLOCKS for f in free) or time.monotonic() > deadline:
            return free
        time.sleep(0.05)


@pytest.mark.slow
def test_a_connector_load_fills_the_prefix_tree_and_the_next_request_reuses_it(tmp_path):
    store = tmp_path / "store"
    with Executor.start(_cfg()) as plain:
        want = plain.generate([P, P2], max_tokens=6)
    with Executor.start(_cfg(store, reuse=True)) as first:  # computes P and saves it
        c = first.wait(first.submit(P, max_tokens=6))
        assert c.tokens == want[0] and c.loaded_tokens == 0 and c.reused_tokens == 0
        assert _settle(first) == [BLOCKS]
    with Executor.start(_cfg(store, reuse=True)) as ex:  # a fresh cache: P's prefix comes from the store
        c = ex.wait(ex.submit(P, max_tokens=6))
        assert c.tokens == want[0] and c.loaded_tokens == 4 * TPB and c.reused_tokens == 0
        assert _settle(ex) == [BLOCKS]
        c2 = ex.wait(ex.submit(P2, max_tokens=6))  # the loaded blocks are in the tree now
        assert c2.tokens == want[1] and c2.reused_tokens == 4 * TPB and c2.loaded_tokens == 0
        assert _settle(ex) == [BLOCKS]
