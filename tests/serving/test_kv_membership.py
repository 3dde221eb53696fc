"""`policy: kv_aware` under a live `disagg_cluster` membership (the router's own registry, and a real etcd
server): a context worker that joins a running deployment is dumped into the router's KV index and then
routed to by what it caches; when it leaves, its blocks are gone from the index at once and no request is
routed to it. Real router and worker processes; every answer equals aggregated decoding."""

from __future__ import annotations

import random

import httpx
import pytest

from kvbridge.bench.common import metric_by

from .cluster import reference
from .etcd_server import EtcdServer
from .members import Deployment, cluster_config

pytestmark = pytest.mark.slow  # real workers; still part of `make test`

ANSWER = 4


def _blocks(router: str) -> dict[str, float]:
    """kvbridge_router_kv_index_blocks per worker, from the router's /metrics."""
    return metric_by(httpx.get(router + "/metrics", timeout=10).text, "kvbridge_router_kv_index_blocks", "worker")


def _ask(router: str, prompt: list[int]) -> dict:
    r = httpx.post(router + "/v1/completions", json={"prompt": prompt, "max_tokens": ANSWER, "temperature": 0},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["kvbridge"]


def _until(dep: Deployment, cond, what: str, timeout: float = 60) -> None:
    dep.wait(lambda _b: cond(), what, timeout)


@pytest.mark.parametrize("backend", ["http", "etcd"])
def test_the_kv_index_follows_workers_that_join_and_leave(backend, tmp_path):
    etcd = EtcdServer(str(tmp_path / "etcd"), str(tmp_path / "etcd.log")).start() if backend == "etcd" else None
    dep = None
    try:
        cfg = cluster_config(etcd.uri if etcd else None, heartbeat_s=1, ttl_s=6)
        cfg["router"] = {**cfg["router"], "policy": "kv_aware", "health_interval_s": 0.5}
        cfg["generation_servers"] = {"tp": 1}  # kv_aware: every worker publishes its prefix cache
        dep = Deployment(tmp_path, cfg)
        dep.start_worker("context", "ctx-a")
        dep.start_worker("generation", "gen-a")
        dep.wait_healthy("ctx-a", "gen-a")

        # join: the new worker is dumped into the index, then routed to by its cache
        dep.start_worker("context", "ctx-b")
        dep.wait_healthy("ctx-b")
        _until(dep, lambda: "ctx-b" in _blocks(dep.router), "ctx-b followed by the router's KV index")
        rng = random.Random(26)
        sent, answers, first = [], [], None
        for _ in range(12):  # distinct prompts: the ties between two empty caches go in turn
            p = [rng.randrange(1, 200) for _ in range(40)]
            kb = _ask(dep.router, p)
            sent.append(p)
            answers.append(kb["token_ids"])
            if kb["route"]["context"]["worker"] == "ctx-b":
                first = p
                break
        assert first is not None, "no prompt was routed to the worker that joined"
        _until(dep, lambda: _blocks(dep.router).get("ctx-b", 0) >= (len(first) - 1) // 8, "ctx-b's blocks in the index")
        follow = first + [rng.randrange(1, 200) for _ in range(12)]
        kb = _ask(dep.router, follow)
        sent.append(follow)
        answers.append(kb["token_ids"])
        ctx = kb["route"]["context"]
        assert ctx["worker"] == "ctx-b" and ctx["hit_tokens"] >= (len(first) - 1) // 8 * 8, ctx

        # leave: unregistered -> its blocks leave the index at once, nothing is routed to it
        dep.procs["ctx-b"].terminate()
        dep.wait(lambda b: "ctx-b" not in b["cluster"]["workers"], "ctx-b unregistered", 60)
        _until(dep, lambda: "ctx-b" not in _blocks(dep.router), "ctx-b's blocks dropped from the index", 10)
        for p in (follow, first):
            kb = _ask(dep.router, p)
            sent.append(p)
            answers.append(kb["token_ids"])
            assert kb["route"]["context"]["worker"] == "ctx-a" and "ctx-b" not in kb["route"]["context"]["candidates"]
        assert dep.procs["ctx-b"].wait(60) == 0, dep.tail("ctx-b")
        assert answers == reference(sent, ANSWER)
    finally:
        if dep is not None:
            dep.stop()
        if etcd is not None:
            etcd.stop()


def _curve_cfg(tmp_path) -> dict:
    """A kv_aware config whose control plane runs CurveZMQ (keys as `kvbridge serve` makes them)."""
    import zmq.auth

    ctx_pub, ctx_sec = zmq.auth.create_certificates(str(tmp_path), "context")
    _gen_pub, gen_sec = zmq.auth.create_certificates(str(tmp_path), "generation")
    return {"model": "seeded:tiny3", "executor": {"num_blocks": 40, "tokens_per_block": 4},
            "router": {"port": 0, "policy": "kv_aware"},
            "context_servers": {"instances": 1, "transceiver": {"curve_secret_key_file": ctx_sec,
                                                                "curve_authorized_keys_dir": str(tmp_path)}},
            "generation_servers": {"instances": 1, "transceiver": {"curve_secret_key_file": gen_sec,
                                                                   "curve_server_public_key_file": ctx_pub}}}


def test_a_leaving_worker_is_forgotten_at_once_and_curve_keys_are_pinned(tmp_path, monkeypatch):
    import zmq
    from kvbridge.executor.kv_events import BlockStored, KVEventBatch
    from kvbridge.serving.auth import TOKEN_ENV
    from kvbridge.serving.balancer import WorkerRef
    from kvbridge.serving.config import parse_config
    from kvbridge.serving.curve_keys import expected_server_keys, uses_curve
    from kvbridge.serving.kv_policy import KvRouting

    monkeypatch.setenv(TOKEN_ENV, "a-token-for-this-test-only-0123456789")
    cfg = parse_config(_curve_cfg(tmp_path))
    assert uses_curve(cfg) and set(expected_server_keys(cfg)) == {"context"}
    kv = KvRouting(cfg)
    try:
        w = WorkerRef("ctx-b", "http://127.0.0.1:9", "context", True)
        kv.index.add_worker("ctx-b", "fp", 4, "i")
        kv.index.apply("ctx-b", 1, KVEventBatch(0.0, (BlockStored((b"\1" * 16,), None, (1, 2, 3, 4), 4),)))
        assert kv.index.count("ctx-b") == 1
        kv.forget(w)  # membership removed it: gone from the index before the call returns
        assert kv.index.count("ctx-b") == 0 and kv.index.info("ctx-b") is None
        eps = {"pub": "tcp://127.0.0.1:9", "replay": "tcp://127.0.0.1:9", "incarnation": "i"}
        kv.on_health(w, {"kv_events": eps})  # no Curve key in a Curve deployment: not followed
        kv.on_health(w, {"kv_events": {**eps, "curve_server_key": zmq.curve_keypair()[0].decode()}})  # not ours
        assert kv.client.barrier(10) and "ctx-b" not in kv.client._conns
    finally:
        kv.close()
