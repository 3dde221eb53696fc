"""`policy: kv_aware` under a live `disagg_cluster` membership (the router's own registry, and a real etcd
server): a context worker that joins a running deployment is dumped into the router's KV index and then
routed to by what it caches; when it leaves, its blocks are gone from the index at once and no request is
routed to it. Real router and worker processes; every answer equals aggregated decoding."""

from __future__ import annotations

import random
import re

import httpx
import pytest

from .cluster import reference
from .etcd_server import EtcdServer
from .members import Deployment, cluster_config

pytestmark = pytest.mark.slow  # real workers; still part of `make test`

ANSWER = 4


def _blocks(router: str) -> dict[str, float]:
    """kvbridge_router_kv_index_blocks per worker, from the router's /metrics."""
    text = httpx.get(router + "/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'^kvbridge_router_kv_index_blocks\{worker="([^"]+)"\} (\S+)$', text, re.MULTILINE)}


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
