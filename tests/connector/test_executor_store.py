"""The persistent store connector in the reference executor: real rank processes, real files, greedy tokens.

An instance saves; a fresh instance loads the stored prefix instead of computing it and must give exactly
the tokens of a fresh prefill, with every block back on the free list afterwards.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from kvbridge.agents.file_agent import HEADER_SIZE
from kvbridge.executor.connector import KvConnectorConfig
from kvbridge.executor.connector.keys import block_keys
from kvbridge.executor.runtime import Executor, ExecutorConfig

TPB = 16
BLOCKS = 96
MODEL = "seeded:tiny"


def _prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


P = _prompt(10 * TPB + 5, 1)                   # 10 full blocks + 5 tokens
Q = _prompt(3 * TPB, 2) + P[3 * TPB:]          # P with a different first 3 blocks
R = _prompt(6 * TPB, 3)                        # whole blocks; saved by a context-only request at release


def _cfg(store=None, tp=1, max_bytes=0, device="cpu"):
    conn = KvConnectorConfig.persistent(str(store), max_bytes=max_bytes) if store is not None else None
    return ExecutorConfig(model=MODEL, tp=tp, num_blocks=BLOCKS, tokens_per_block=TPB, timeout_s=60,
                          kv_connector_config=conn, device=device)


def _settle(ex, timeout=30.0) -> list[int]:
    """Free blocks per rank once the connector's saves have ended (held blocks come back then)."""
    deadline = time.monotonic() + timeout
    while True:
        free = ex.free_blocks()
        if all(f == BLOCKS for f in free) or time.monotonic() > deadline:
            return free
        time.sleep(0.05)


def _files(root) -> list[str]:
    return sorted(str(p) for p in root.rglob("*.kvb"))


@pytest.fixture(scope="module")
def fresh():
    """Greedy tokens of a fresh prefill (no connector) for every prompt the tests use."""
    with Executor.start(_cfg()) as ex:
        return dict(zip("PQR", ex.generate([P, Q, R], max_tokens=6)))


@pytest.fixture(scope="module")
def stored(tmp_path_factory, fresh):
    """A store written by a first instance: P (aggregated, saved when it finished), R (context-only, saved
    when it was released)."""
    store = tmp_path_factory.mktemp("stored") / "store"
    with Executor.start(_cfg(store)) as ex:
        c = ex.wait(ex.submit(P, max_tokens=6))
        assert c.tokens == fresh["P"] and c.loaded_tokens == 0
        ctx = ex.prefill(R)
        ex.release(ctx.request_id)
        assert _settle(ex) == [BLOCKS]  # every held block came back once the saves ended
    return store


def test_a_second_instance_loads_the_stored_prefix_and_decodes_the_same_tokens(tmp_path, fresh, stored):
    store = tmp_path / "store"
    shutil.copytree(stored, store)
    # P: 10 full prompt blocks (+ 5 decoded tokens' KV: 170 tokens, still 10 full blocks); R: 6
    assert len(_files(store)) == 16
    with Executor.start(_cfg(store)) as ex:
        c = ex.wait(ex.submit(P, max_tokens=6))
        assert c.tokens == fresh["P"] and c.loaded_tokens == 10 * TPB
        q = ex.wait(ex.submit(Q, max_tokens=6))  # P's later blocks after another prefix: all misses
        assert q.tokens == fresh["Q"] and q.loaded_tokens == 0
        r = ex.wait(ex.submit(R, max_tokens=6))  # the last prompt token is always computed
        assert r.tokens == fresh["R"] and r.loaded_tokens == 6 * TPB - TPB
        assert _settle(ex) == [BLOCKS]


def test_damaged_files_are_misses_and_the_tokens_stay_exact(tmp_path, fresh, stored):
    store = tmp_path / "store"
    shutil.copytree(stored, store)
    files = {os.path.basename(f): f for f in _files(store)}
    ns = os.path.basename(os.path.dirname(os.path.dirname(os.path.dirname(next(iter(files.values()))))))
    keys = block_keys(ns, P, TPB)
    with Executor.start(_cfg(store)) as ex:
        # a truncated file: the probe stops before it; the blocks before it still load
        with open(files[keys[7] + ".kvb"], "r+b") as f:
            f.truncate(HEADER_SIZE + 100)
        c = ex.wait(ex.submit(P, max_tokens=6))
        assert c.tokens == fresh["P"] and c.loaded_tokens == 7 * TPB
        # a flipped payload byte: the header looks fine, the checksum fails at load, the prompt is recomputed
        raw = bytearray(Path(files[keys[2] + ".kvb"]).read_bytes())
        raw[HEADER_SIZE + 999] ^= 0x40
        Path(files[keys[2] + ".kvb"]).write_bytes(bytes(raw))
        c = ex.wait(ex.submit(P, max_tokens=6))
        assert c.tokens == fresh["P"] and c.loaded_tokens == 0
        assert _settle(ex) == [BLOCKS]


def test_an_aborted_load_frees_its_blocks_only_after_the_load_ended(tmp_path, fresh, stored):
    store = tmp_path / "store"
    shutil.copytree(stored, store)
    cfg = _cfg(store)
    gate = tmp_path / "loads-may-end"  # the slow store reports no load as ended until this file exists
    cfg.kv_connector_config = KvConnectorConfig("tests.connector.slow_store", "PersistentKvConnectorScheduler",
                                                "SlowLoadWorker", {"root": str(store), "gate": str(gate)})
    with Executor.start(cfg) as ex:
        rid = ex.submit(P, max_tokens=6)
        deadline = time.monotonic() + 30
        while ex.free_blocks() == [BLOCKS]:
            assert time.monotonic() < deadline, "the request was not admitted (no blocks taken) within 30 s"
            time.sleep(0.02)  # until admitted: blocks allocated, the load going on
        ex.abort(rid)
        assert ex.wait(rid).finish_reason == "aborted"
        assert ex.free_blocks() == [BLOCKS - 11]  # held: the store may still be writing into them
        gate.touch()  # now the load ends: only then do its blocks come back
        assert _settle(ex) == [BLOCKS]
        c = ex.wait(ex.submit(P, max_tokens=6))  # the executor goes on: the same prompt loads and decodes
        assert c.tokens == fresh["P"] and c.loaded_tokens == 10 * TPB


def test_tp2_ranks_store_their_own_shards_under_a_size_bound(tmp_path):
    store = tmp_path / "store"
    prompts = [_prompt(8 * TPB + 3, 10 + i) for i in range(6)]
    key_bytes = 2 * (HEADER_SIZE + TPB * 4 * 2 * 2 * 32 * 4)  # 2 ranks x (4 layers, K+V, 2 heads, 32 dims, f32)
    bound = 20 * key_bytes  # room for 20 keys; 6 prompts x 8 blocks are written
    with Executor.start(_cfg(store, tp=2, max_bytes=bound)) as ex:
        want = [ex.wait(ex.submit(p, max_tokens=4)) for p in prompts]
        assert all(w.loaded_tokens == 0 for w in want)
        assert _settle(ex) == [BLOCKS, BLOCKS]
    assert {os.path.basename(os.path.dirname(os.path.dirname(f))) for f in _files(store)} == {"r0", "r1"}
    usage = sum(os.path.getsize(f) for f in store.rglob("*") if f.is_file())
    assert usage <= bound
    with Executor.start(_cfg(store, tp=2)) as ex:  # the most recently used prompt survived eviction
        got = ex.wait(ex.submit(prompts[-1], max_tokens=4))
        assert got.loaded_tokens == 8 * TPB and got.tokens == want[-1].tokens
        assert _settle(ex) == [BLOCKS, BLOCKS]


@pytest.mark.cuda
def test_on_gpu_a_second_instance_loads_the_stored_prefix_and_decodes_the_same_tokens(tmp_path):
    store = tmp_path / "store"
    with Executor.start(_cfg(device="cuda")) as ex:
        want = ex.generate([P], max_tokens=6)[0]
    for loaded in (0, 10 * TPB):  # instance 1 computes and saves (bf16 pool on the GPU), instance 2 loads
        with Executor.start(_cfg(store, device="cuda")) as ex:
            c = ex.wait(ex.submit(P, max_tokens=6))
            assert c.tokens == want and c.loaded_tokens == loaded
            assert _settle(ex) == [BLOCKS]
