"""A `disagg_cluster` deployment through the router's own registry (http://), real processes: 503 +
Retry-After below minimal_instances; a duplicate worker id, a forged registration (no proof, a wrong
signature) and a stale incarnation refused by name while the real workers keep serving exact answers; a
registration that disappears (record deleted, or the router and its in-memory registry restarted) comes back
by itself; and `kvbridge serve` of a trtllm-serve YAML with `disagg_cluster` starts workers that join, with
a hand-started `kvbridge worker` joining the same deployment."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import pytest
import yaml
from kvbridge.serving.registry.http_store import PROOF_HEADER, HttpStore
from kvbridge.serving.registry.records import (
    WorkerRecord,
    access_proof,
    encode,
    registry_key,
    worker_key,
    workers_prefix,
)

from .cluster import HEADERS, MODEL, PROMPTS, TOKEN, Serve, start_announced, stop_process
from .conftest import MAX_TOKENS
from .kvcheck import assert_kv_positional
from .members import Deployment, cluster_config

pytestmark = pytest.mark.slow  # real workers; still part of `make test`

KEY = registry_key(TOKEN, "kvbridge")


@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    # a long lease: a worker killed by kill -9 is still registered when its replacement registers
    d = Deployment(tmp_path_factory.mktemp("cluster"), cluster_config(None, heartbeat_s=1, ttl_s=60))
    try:
        d.start_worker("context", "ctx-a")
        d.start_worker("generation", "gen-a")
        d.wait_healthy("ctx-a", "gen-a")
        yield d
    finally:
        d.stop()


def _exact_through(dep: Deployment, want) -> None:
    with openai.OpenAI(base_url=dep.router + "/v1", api_key="unused", timeout=120, max_retries=0) as oc:
        out = oc.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0)
    kb = out.model_extra["kvbridge"]
    assert kb["token_ids"] == want["prompts"][1]
    assert assert_kv_positional(dep.url(kb["context_worker"]), dep.url(kb["generation_worker"]),
                                [kb["handle"]]) == 1


def test_below_minimal_instances_the_router_answers_503_with_retry_after(tmp_path):
    d = Deployment(tmp_path, cluster_config(None, minimal_instances={"context_servers": 2}))
    try:
        r = httpx.post(d.router + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and float(r.headers["Retry-After"]) > 0
        err = r.json()["error"]
        assert err["code"] == "not_enough_workers" and "context 0/2, generation 0/1" in err["message"]
        body = d.health()
        assert body["status"] == "unavailable" and body["cluster"]["minimal_instances"] == \
            {"context": 2, "generation": 1}
    finally:
        d.stop()


def test_a_duplicate_worker_id_is_refused_and_the_worker_exits_naming_it(dep, want):
    p = dep.start_worker("context", "ctx-a", tag="ctx-a-twin")
    assert p.wait(240) == 2
    assert "duplicate worker id 'ctx-a': it is registered by a live worker at " + dep.url("ctx-a") in \
        dep.tail("ctx-a-twin")
    del dep.procs["ctx-a-twin"]
    _exact_through(dep, want)  # the live one is still the registered one


def test_forged_and_stale_registrations_are_refused_by_name(dep, want):
    real = dep.members()["ctx-a"]
    k = worker_key("kvbridge", "ctx-a")
    r = httpx.post(dep.router + "/internal/registry/set", json={"key": k, "value": "x", "ttl_s": 5}, timeout=10)
    assert r.status_code == 401  # no proof: not even stored
    r = httpx.post(dep.router + "/internal/registry/set", json={"key": k, "value": "x", "ttl_s": 5}, timeout=10,
                   headers={PROOF_HEADER: access_proof(registry_key("not-the-token" * 3, "kvbridge"))})
    assert r.status_code == 401

    def rec(**kw) -> WorkerRecord:
        return WorkerRecord(**{**dict(cluster="kvbridge", worker_id="ctx-a", role="context",
                                      url="http://127.0.0.1:9", model=MODEL, incarnation="evil", started_ns=1),
                               **kw})

    async def put(value: str) -> None:
        s = HttpStore(dep.router, KEY, 5.0)  # the proof is right: only the signature decides
        try:
            await s.set(k, value, 5)
        finally:
            await s.close()

    forged = encode(rec(started_ns=time.time_ns()), registry_key("another-token" * 3, "kvbridge"))
    stale = encode(rec(incarnation="ctx-a-old"), KEY)  # signed right, but started before the live one
    for value, reason in ((forged, "forged"), (stale, "stale_incarnation")):
        asyncio.run(put(value))
        body = dep.wait(lambda b: any(x["reason"] == reason for x in b["cluster"]["refused"]), reason, 30)
        assert body["cluster"]["workers"]["ctx-a"] == real  # still routed to the real worker
    _exact_through(dep, want)


def test_a_lost_registration_comes_back_and_survives_a_router_restart(dep, want, tmp_path):
    async def delete() -> None:
        s = HttpStore(dep.router, KEY, 5.0)
        try:
            w = s.watch(workers_prefix("kvbridge"))  # the router's registry as any client sees it
            snap = await anext(w)
            assert {worker_key("kvbridge", n) for n in ("ctx-a", "gen-a")} <= set(snap.entries)
            await s.delete(worker_key("kvbridge", "gen-a"))
            change = await anext(w)
            assert (change.kind, change.key) == ("delete", worker_key("kvbridge", "gen-a"))
            await w.aclose()
        finally:
            await s.close()

    asyncio.run(delete())
    dep.wait(lambda b: "gen-a" in b["cluster"]["workers"] and b["cluster"]["workers"]["gen-a"]["healthy"],
             "gen-a registered again", 30)
    assert "registering again" in dep.tail("gen-a")
    # the router (and the registry it holds) restarts on its port: every worker registers again by itself
    port = int(dep.router.rsplit(":", 1)[1])
    stop_process(dep.router_proc)
    with open(tmp_path / "router.yaml", "w") as f:
        yaml.safe_dump({**cluster_config(None), "router": {"port": port, "request_timeout_s": 120,
                                                           "health_interval_s": 0.5}}, f)
    dep.router_proc, _ = start_announced(["router", "--config", str(tmp_path / "router.yaml")],
                                         str(dep.tmp / "router2.log"), timeout=120)
    dep.wait_healthy("ctx-a", "gen-a", timeout=60)
    _exact_through(dep, want)


def test_a_restarted_worker_replaces_its_old_incarnation_whose_kv_handles_fail(dep, want):
    old = dep.members()["ctx-a"]
    with httpx.Client(headers=HEADERS, timeout=60) as c:  # a prefill whose KV the old incarnation pins
        r = c.post(old["url"] + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
                                                        "temperature": 0,
                                                        "disaggregated_params": {"request_type": "context_only"}})
        assert r.status_code == 200, r.text
        params = r.json()["disaggregated_params"]
        dep.kill9("ctx-a")
        dep.start_worker("context", "ctx-a")  # the same id, before the old lease ran out: it replaces it
        body = dep.wait(lambda b: b["cluster"]["workers"].get("ctx-a", {}).get("incarnation") not in
                        (None, old["incarnation"]) and b["cluster"]["workers"]["ctx-a"]["healthy"],
                        "the new incarnation of ctx-a", 240)
        assert body["cluster"]["workers"]["ctx-a"]["url"] != old["url"]
        assert "replaces " + old["incarnation"] in dep.router_log()
        r = c.post(dep.url("gen-a") + "/v1/completions",
                   json={"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0,
                         "disaggregated_params": params})
        assert r.status_code == 502 and r.json()["error"]["code"] == "kv_transfer_failed", r.text
    _exact_through(dep, want)


TRTLLM = {"hostname": "127.0.0.1", "port": 0, "model": MODEL, "backend": "pytorch",
          "disagg_cluster": {"minimal_instances": {"context_servers": 1, "generation_servers": 1},
                             "heartbeat_interval_sec": 1, "inactive_interval_sec": 4},
          "kv_cache_config": {"max_tokens": 2048, "tokens_per_block": 8},
          "cache_transceiver_config": {"backend": "DEFAULT"},
          "context_servers": {"num_instances": 1, "tensor_parallel_size": 1},
          "generation_servers": {"num_instances": 1, "tensor_parallel_size": 1},
          "kvbridge": {"transceiver": {"agent": "tcp"}, "router": {"health_interval_s": 0.5}}}


def test_serve_starts_workers_that_join_and_a_hand_started_worker_joins_too(tmp_path, want):
    keys = tmp_path / "keys"  # serve makes the control plane's CurveZMQ keys here; a joining worker needs them
    s = Serve(tmp_path, {**TRTLLM, "kvbridge": {**TRTLLM["kvbridge"], "keys_dir": str(keys)}})
    hand = None
    try:
        router = s.router
        gen_keys = {"curve_secret_key_file": str(keys / "generation.key_secret"),
                    "curve_server_public_key_file": str(keys / "context.key")}
        with open(tmp_path / "hand.yaml", "w") as f:
            yaml.safe_dump({**TRTLLM, "disagg_cluster": {**TRTLLM["disagg_cluster"], "cluster_uri": router},
                            "kvbridge": {**TRTLLM["kvbridge"],
                                         "generation_servers": {"transceiver": gen_keys}}}, f)
        from .cluster import start_process

        hand = start_process(["worker", "--config", str(tmp_path / "hand.yaml"), "--role", "generation",
                              "--name", "gen-hand"], str(tmp_path / "hand.log"))
        deadline = time.monotonic() + 240
        while True:
            w = httpx.get(router + "/health", timeout=10).json()["cluster"]["workers"]
            if w.get("gen-hand", {}).get("healthy"):
                break
            assert hand.poll() is None and time.monotonic() < deadline, (tmp_path / "hand.log").read_text()[-2000:]
            time.sleep(0.2)
        assert set(w) == {"ctx0", "gen0", "gen-hand"}
        served = set()
        with openai.OpenAI(base_url=router + "/v1", api_key="unused", timeout=120, max_retries=0) as oc:
            for _ in range(4):
                out = oc.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
                assert out.model_extra["kvbridge"]["token_ids"] == want["prompts"][0]
                served.add(out.model_extra["kvbridge"]["generation_worker"])
        assert served == {"gen0", "gen-hand"}, httpx.get(router + "/health", timeout=10).json()
        assert re.search(r"registered as context worker", s.log.read_text())
    finally:
        if hand is not None:
            stop_process(hand)
        s.stop()
