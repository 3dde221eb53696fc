"""`policy: kv_aware` through real serving processes (2 context workers, 1 generation worker, tcp agent): the
turns of a conversation go where its history is cached (the decision and its inputs in `kvbridge.route`),
answers equal aggregated decoding, the router's metrics show its index, and an index fed from the workers'
advertised endpoints (/health, with the internal token) equals every worker's own dump, evictions included."""

from __future__ import annotations

import random
import time

import httpx
import pytest
from kvbridge.executor.kv_events import derive_secret
from kvbridge.serving.kv_index import KvIndex
from kvbridge.serving.kv_subscriber import KvEventsClient

from .cluster import HEADERS, MODEL, PATIENT, TOKEN, launch, reference

TPB = 4
CFG = {
    "model": MODEL,
    "executor": {"num_blocks": 40, "tokens_per_block": TPB, "threads_per_rank": 1, "timeout_s": 120},
    "transceiver": {"agent": "tcp", "handshake_timeout_s": 3, **PATIENT},
    "router": {"port": 0, "request_timeout_s": 120, "policy": "kv_aware", "health_interval_s": 0.5},
    "context_servers": {"instances": 2, "tp": 1},
    "generation_servers": {"instances": 1, "tp": 1},
}
ANSWER = 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = launch(CFG, str(tmp_path_factory.mktemp("logs")))
    yield c
    c.stop()


def _ask(router: str, prompt: list[int]) -> dict:
    r = httpx.post(router + "/v1/completions", json={"prompt": prompt, "max_tokens": ANSWER, "temperature": 0},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["kvbridge"]


def test_turns_of_a_conversation_follow_their_cache_and_answers_equal_aggregated(cluster):
    rng = random.Random(5)
    convs = [[rng.randrange(1, 200) for _ in range(4 * TPB + 1)] for _ in range(3)]
    sent, got, first = [], [], {}
    for turn in range(3):
        for c, prompt in enumerate(convs):
            kb = _ask(cluster.router_url, prompt)
            route = kb["route"]
            ctx = route["context"]
            assert set(ctx["candidates"]) == {s.name for s in cluster.cfg.context} and ctx["prompt_tokens"] == \
                len(prompt)
            if turn == 0:
                first[c] = ctx["worker"]
            else:  # its history is cached where it went first; the other worker holds none of it
                assert ctx["worker"] == first[c], route
                assert ctx["candidates"][ctx["worker"]]["hit_tokens"] + \
                    ctx["candidates"][ctx["worker"]]["spec_tokens"] >= (len(prompt) - 2 * TPB) // TPB * TPB
            sent.append(prompt)
            got.append(kb["token_ids"])
            convs[c] = prompt + kb["token_ids"] + [rng.randrange(1, 200) for _ in range(3)]
    assert got == reference(sent, ANSWER)
    metrics = httpx.get(cluster.router_url + "/metrics", timeout=30).text
    assert 'kvbridge_router_kv_index{what="entries"}' in metrics
    assert 'kvbridge_router_kv_tokens_total{kind="hit",role="context"}' in metrics


def test_an_index_from_the_advertised_endpoints_equals_every_workers_dump(cluster):
    client = KvEventsClient(KvIndex(), derive_secret(TOKEN), replay_timeout_s=10)
    try:
        names = []
        for s in cluster.cfg.context + cluster.cfg.generation:
            h = httpx.get(s.url + "/health", headers=HEADERS, timeout=30).json()
            assert len(h["kv_events"]["curve_server_key"]) == 40  # serve's control plane is Curve: so are events
            client.sync_worker(s.name, h["kv_events"])
            names.append(s.name)
        rng = random.Random(11)
        for _ in range(12):  # 40-block pools: these prompts overflow them, so blocks are evicted
            _ask(cluster.router_url, [rng.randrange(1, 200) for _ in range(rng.randrange(9, 40))])
        for name in names:
            deadline = time.monotonic() + 60
            while True:
                d = client._ask(client._conns[name], {"op": "dump"}) if name in client._conns else None
                truth = {bytes(b[0]): b[1] for b in d["blocks"]} if d else None
                if d and client.last_seq(name) == d["seq"] and client.index.blocks_of(name) == truth:
                    break
                assert time.monotonic() < deadline, f"{name}: the index never matched the worker's dump"
                time.sleep(0.1)
        assert client.stats["rejected"] == 0 and client.stats["batches"] > 0
    finally:
        client.close()


def test_kv_aware_settings_are_checked_by_name():
    from kvbridge.errors import ServeConfigError
    from kvbridge.serving.config import parse_config

    d = {**CFG, "router": {**CFG["router"], "kv_aware": {"prefill_weight": -1}}}
    with pytest.raises(ServeConfigError, match=r"router\.kv_aware\.prefill_weight: expected a number >= 0"):
        parse_config(d)
    d = {**CFG, "router": {**CFG["router"], "kv_aware": {"spec_tll_s": 1}}}
    with pytest.raises(ServeConfigError, match=r"router\.kv_aware\.spec_tll_s: unknown key"):
        parse_config(d)
    assert parse_config({**CFG, "router": {**CFG["router"], "kv_aware": {"spec_ttl_s": 0.5}}}).router.kv_aware == \
        {"spec_ttl_s": 0.5}


def test_the_cost_prefers_the_cached_worker_until_its_load_outweighs_the_cache(monkeypatch):
    from kvbridge.executor.kv_events import BlockStored, KVEventBatch
    from kvbridge.kvcache.prefix_tree import chain_keys
    from kvbridge.serving.auth import TOKEN_ENV
    from kvbridge.serving.balancer import Pool, WorkerRef
    from kvbridge.serving.config import parse_config
    from kvbridge.serving.kv_policy import KvRouting

    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    kv = KvRouting(parse_config(CFG))
    try:
        pool = Pool([WorkerRef("a", "http://a", "context", True), WorkerRef("b", "http://b", "context", True)],
                    "kv_aware")
        prompt = list(range(1, 42))  # 10 full blocks
        keys = chain_keys("fp", prompt, TPB)
        for w in ("a", "b"):
            kv.index.add_worker(w, "fp", TPB, "i")
        kv.index.apply("b", 1, KVEventBatch(0.0, (BlockStored(tuple(keys[:8]), None, tuple(prompt[:32]), TPB),)))
        w, d = kv.pick(pool, "context", prompt)
        assert w.name == "b" and d["hit_tokens"] == 32 and d["candidates"]["a"]["uncached_blocks"] == 10
        assert d["candidates"]["b"]["cost"] == 2.0 and d["candidates"]["a"]["cost"] == 10.0
        kv.settle(w, d)
        w, d = kv.pick(pool, "context", prompt)  # the 2 blocks routed there count as held for spec_ttl_s
        assert w.name == "b" and d["candidates"]["b"]["spec_tokens"] == 8 and d["candidates"]["b"]["cost"] == 0
        kv.settle(w, d)
        pool.workers[1].in_flight = 11  # b is busy: 11 x request_weight > the 10 blocks a would compute
        w, d = kv.pick(pool, "context", prompt)
        assert w.name == "a" and d["candidates"]["b"]["cost"] == 11.0
    finally:
        kv.close()


@pytest.fixture(scope="module")
def local_cluster(tmp_path_factory):
    cfg = {**CFG, "router": {**CFG["router"], "kv_aware": {"local_prefill_tokens": 2 * TPB}},
           "context_servers": {"instances": 1, "tp": 1}}
    c = launch(cfg, str(tmp_path_factory.mktemp("logs-local")))
    yield c
    c.stop()


def test_a_short_uncached_tail_is_prefilled_by_the_generation_worker_itself(local_cluster):
    rng = random.Random(8)
    prompt = [rng.randrange(1, 200) for _ in range(6 * TPB + 1)]
    first = _ask(local_cluster.router_url, prompt)
    assert "local_prefill" not in first["route"] and first["context_worker"]  # nothing cached yet
    second_prompt = prompt + first["token_ids"] + [rng.randrange(1, 200) for _ in range(3)]
    deadline = time.monotonic() + 60
    while True:  # the generation worker's events (its decoded blocks) reach the router, bounded
        kb = _ask(local_cluster.router_url, second_prompt)
        if "local_prefill" in kb["route"] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert kb["route"]["local_prefill"]["tail_tokens"] <= 2 * TPB and "context" not in kb["route"], kb["route"]
    assert not kb.get("context_worker")
    assert [first["token_ids"], kb["token_ids"]] == reference([prompt, second_prompt], ANSWER)
