"""Block keys chained over the prefix, the store's probes (damaged files are misses), LRU eviction under a bound."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvbridge.agents import DescriptorList, MemoryRegion
from kvbridge.agents.file_agent import HEADER_SIZE, FileAgent, file_set, object_addrs
from kvbridge.executor.connector import store as store_mod
from kvbridge.executor.connector.keys import block_keys, namespace_for
from kvbridge.executor.connector.store import TMP_GRACE_S, KvStore
from kvbridge.formatter.layout import KVLayout, KVShape, ParallelSplit

from .procs import evict_loop

TPB = 16
LAYOUT = KVLayout(KVShape(4, 4, 32, "float32", TPB), ParallelSplit(2, 1))
NS = namespace_for(LAYOUT, "seeded:tiny", {"vocab_size": 256})
PAYLOAD = 4096


def _tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 50000, n)]


def _put(store: KvStore, keys: list[str], ranks=(0, 1)) -> None:
    """Write each key's object on `ranks` through the file agent (the way the connector's workers do)."""
    buf = np.arange(len(keys) * PAYLOAD, dtype=np.uint8)
    agent = FileAgent("put")
    reg = agent.register_memory(MemoryRegion.of(buf))
    for r in ranks:
        peer = agent.connect(file_set(store.rank_dir(r), keys, store.tag(r)))
        n = len(keys)
        h = agent.write(peer, DescriptorList(buf.ctypes.data + np.arange(n) * PAYLOAD, np.full(n, PAYLOAD)),
                        DescriptorList(object_addrs(np.arange(n)), np.full(n, PAYLOAD)))
        h.wait(30)
        h.release()
    reg.release()
    agent.close()


def test_the_same_block_after_a_different_prefix_is_a_miss(tmp_path):
    block = _tokens(TPB, 1)
    a = _tokens(2 * TPB, 2) + block
    b = _tokens(2 * TPB, 3) + block
    ka, kb = block_keys(NS, a, TPB), block_keys(NS, b, TPB)
    assert len(ka) == 3 and ka[2] != kb[2]  # same 16 tokens, different prefix: different key
    st = KvStore(str(tmp_path), NS, 2)
    _put(st, ka)
    assert st.probe(ka) == 3
    assert st.probe(kb) == 0
    assert st.probe(block_keys(NS, a[:2 * TPB] + _tokens(TPB, 4), TPB)) == 2  # the shared prefix still hits


def test_keys_are_stable_across_processes_and_separate_models_and_layouts():
    toks = _tokens(5 * TPB + 3, 5)
    keys = block_keys(NS, toks, TPB)
    assert len(keys) == 5 and all(len(k) == 64 for k in keys)
    code = ("from kvbridge.executor.connector.keys import block_keys; import sys, json; "
            "print(json.dumps(block_keys(sys.argv[1], json.loads(sys.argv[2]), 16)))")
    out = subprocess.run([sys.executable, "-c", code, NS, str(toks)], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}, timeout=60)
    assert out.stdout.strip() == str(keys).replace("'", '"')
    other_model = namespace_for(LAYOUT, "seeded:tiny,seed=1", {"vocab_size": 256})
    other_split = namespace_for(KVLayout(KVShape(4, 4, 32, "float32", TPB), ParallelSplit(1, 2)), "seeded:tiny",
                                {"vocab_size": 256})
    assert len({NS, other_model, other_split}) == 3
    assert block_keys(other_model, toks, TPB)[0] != keys[0]


@pytest.mark.parametrize("damage", ["truncate", "missing_on_one_rank", "foreign_name", "garbage"])
def test_a_damaged_or_partial_key_is_a_logged_miss(tmp_path, caplog, damage):
    st = KvStore(str(tmp_path), NS, 2)
    keys = block_keys(NS, _tokens(4 * TPB, 6), TPB)
    _put(st, keys)
    path = st.path(keys[2], 1)
    if damage == "truncate":
        with open(path, "r+b") as f:
            f.truncate(HEADER_SIZE + PAYLOAD - 1)
    elif damage == "missing_on_one_rank":
        os.unlink(path)
    elif damage == "foreign_name":
        os.replace(st.path(keys[3], 1), path)  # another key's file under this key's name
    else:
        Path(path).write_bytes(b"not a kvbridge object" * 10)
    with caplog.at_level(logging.WARNING, logger="kvbridge.executor.connector.store"):
        assert st.probe(keys) == 2
    assert st.missing(keys) == ([2] if damage != "foreign_name" else [2, 3])
    if damage != "missing_on_one_rank":
        assert any("unusable" in r.message and path in r.message for r in caplog.records)


def test_eviction_keeps_the_root_under_its_bound_deleting_least_recently_used_keys_whole(tmp_path):
    st = KvStore(str(tmp_path), NS, 2, max_bytes=40 * (PAYLOAD + HEADER_SIZE))  # room for 20 keys x 2 ranks
    keys = block_keys(NS, _tokens(60 * TPB, 7), TPB)
    _put(st, keys)
    old = time.time() - 3600
    for i, k in enumerate(keys):  # key i last used at old + i
        for r in (0, 1):
            os.utime(st.path(k, r), (old + i, old + i))
    assert st.probe(keys[:5]) == 5  # a hit makes the first five the most recent
    stale = os.path.join(st.rank_dir(0), "ab", "stale.kvb.tmp.1.x")
    young = os.path.join(st.rank_dir(0), "ab", "young.kvb.tmp.2.y")
    for p, t in ((stale, time.time() - TMP_GRACE_S - 60), (young, time.time())):
        os.makedirs(os.path.dirname(p), exist_ok=True)
        Path(p).write_bytes(b"x" * 100)
        os.utime(p, (t, t))
    stats = st.evict()
    assert stats.bytes_before > st.max_bytes >= st.usage()
    kept = [k for k in keys if os.path.exists(st.path(k, 0))]
    assert kept == [k for k in keys if os.path.exists(st.path(k, 1))]  # keys go whole, never one rank's shard
    assert keys[:5] == kept[:5] and set(kept[5:]) == set(keys[-len(kept) + 5:])  # LRU: the newest survive
    assert not os.path.exists(stale) and os.path.exists(young)


def test_eviction_tolerates_files_vanishing_and_two_processes_evicting_at_once(tmp_path, monkeypatch):
    st = KvStore(str(tmp_path), NS, 2, max_bytes=20 * (PAYLOAD + HEADER_SIZE))
    keys = block_keys(NS, _tokens(50 * TPB, 8), TPB)
    _put(st, keys)
    real = store_mod._scan

    def racing_scan(root):  # another instance deletes every third file right after we listed it
        for i, (path, name, stat) in enumerate(real(root)):
            if i % 3 == 0:
                os.unlink(path)
            yield path, name, stat

    monkeypatch.setattr(store_mod, "_scan", racing_scan)
    assert st.evict() is not None
    monkeypatch.setattr(store_mod, "_scan", real)
    assert st.usage() <= st.max_bytes
    _put(st, block_keys(NS, _tokens(50 * TPB, 9), TPB))
    ctx = mp.get_context("spawn")
    with ctx.Pool(2) as pool:
        runs = [pool.apply_async(evict_loop, (str(tmp_path), NS, st.max_bytes, 20)) for _ in range(2)]
        assert sum(r.get(120) for r in runs) >= 1
    assert st.usage() <= st.max_bytes


def test_note_written_evicts_in_the_background_once_over_the_bound(tmp_path):
    st = KvStore(str(tmp_path), NS, 2, max_bytes=10 * (PAYLOAD + HEADER_SIZE))
    _put(st, block_keys(NS, _tokens(30 * TPB, 10), TPB))
    st.note_written(60 * (PAYLOAD + HEADER_SIZE))  # first call: no estimate yet -> scans
    st.close(30)
    assert st.usage() <= st.max_bytes and st.last_evict is not None
