"""The cluster registry's parts without workers: the Store interface on both backends that really run (the
router's in-memory store, a real etcd server), signed records, the disagg_cluster config (kvbridge's and a
trtllm-serve YAML's), and the router's membership refusing forged, stale and insecure registrations by name."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest
import yaml
from kvbridge.errors import ServeConfigError
from kvbridge.serving.auth import TOKEN_ENV
from kvbridge.serving.config import parse_config
from kvbridge.serving.membership import RegistryWorkers
from kvbridge.serving.protocol import ApiError
from kvbridge.serving.registry import Change, Conflict, Snapshot, open_store
from kvbridge.serving.registry.memory import MemoryStore
from kvbridge.serving.registry.records import (
    RegistrationRefused,
    WorkerRecord,
    decode,
    encode,
    registry_key,
    worker_key,
)

from .cluster import MODEL
from .etcd_server import EtcdServer

TOKEN = "t" * 40
KEY = registry_key(TOKEN, "c1")


def _run(coro, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    d = tmp_path_factory.mktemp("etcd")
    srv = EtcdServer(str(d / "data"), str(d / "etcd.log")).start()
    yield srv
    srv.stop()


@pytest.fixture(params=["memory", "etcd"])
def make_store(request):
    if request.param == "memory":
        return lambda: MemoryStore()
    srv = request.getfixturevalue("etcd")
    return lambda: open_store(srv.uri, KEY, 2.0)


def test_store_sets_conditionally_expires_leases_and_watches_snapshot_then_changes(make_store):
    prefix = f"/t{time.monotonic_ns()}/"

    async def body(s):
        sweeper = asyncio.create_task(s.run_sweeper()) if isinstance(s, MemoryStore) else None
        try:  # (the router runs a memory store's sweeper; here the test does)
            w = s.watch(prefix)
            snap = await anext(w)
            assert isinstance(snap, Snapshot) and snap.entries == {}
            lease, rev = await s.set(prefix + "a", "1", 2, prev_revision=0)
            with pytest.raises(Conflict) as e:  # create-only: the key exists
                await s.set(prefix + "a", "2", 2, prev_revision=0)
            assert e.value.current.value == "1" and e.value.current.revision == rev
            lease2, _ = await s.set(prefix + "a", "2", 2, prev_revision=rev)  # compare-and-swap
            assert (await s.get(prefix + "a")).value == "2"
            assert await s.refresh(lease2)
            await s.set(prefix + "b", "x", 2)
            assert set(await s.list(prefix)) == {prefix + "a", prefix + "b"}
            await s.revoke(lease2)
            assert await s.get(prefix + "a") is None
            t0 = time.monotonic()  # b is never refreshed: gone when its lease runs out
            while await s.get(prefix + "b") is not None:
                assert time.monotonic() - t0 < 15, "a lease did not run out"
                await asyncio.sleep(0.2)
            seen = []
            while len(seen) < 5:
                c = await anext(w)
                assert isinstance(c, Change)
                seen.append((c.kind, c.key.removeprefix(prefix), c.value))
            assert seen == [("put", "a", "1"), ("put", "a", "2"), ("put", "b", "x"), ("delete", "a", ""),
                            ("delete", "b", "")]
            await w.aclose()
        finally:
            if sweeper is not None:
                sweeper.cancel()
            await s.close()

    _run(body(make_store()))


def _rec(**kw) -> WorkerRecord:
    d = dict(cluster="c1", worker_id="ctx-a", role="context", url="http://127.0.0.1:9", model=MODEL,
             incarnation="ctx-a-1", started_ns=10, endpoints=("tcp://127.0.0.1:1",), capacity_tokens=512)
    return WorkerRecord(**{**d, **kw})


def test_a_record_is_accepted_only_with_the_deployments_signature_under_its_own_key():
    k = worker_key("c1", "ctx-a")
    assert decode(k, encode(_rec(), KEY), KEY) == _rec()
    cases = {
        "forged": [encode(_rec(), registry_key("x" * 40, "c1")),                  # another token
                   encode(_rec(), KEY).replace('"sig":"', '"sig":"0'),             # a wrong signature
                   encode(_rec(), KEY).replace("127.0.0.1:9", "10.6.6.6:9"),       # tampered after signing
                   json.dumps({"v": 1, "record": _rec().to_json()})],                # no signature
        "malformed": ["not json", '{"v":2,"record":{},"sig":"x"}', encode(_rec(worker_id="gen-z"), KEY)],
    }
    for reason, values in cases.items():
        for v in values:
            with pytest.raises(RegistrationRefused) as e:
                decode(k, v, KEY)
            assert e.value.reason == reason, (v, e.value)
    assert "signature does not match" in str(pytest.raises(RegistrationRefused, decode, k, cases["forged"][0],
                                                             KEY).value)


def test_a_vllm_servers_relayed_kv_events_ride_in_its_record_signed_and_checked():
    k, kv = worker_key("c1", "ctx-a"), {"pub": "tcp://127.0.0.1:5", "replay": "tcp://127.0.0.1:6",
                                        "incarnation": "ctx-a-1"}
    assert "kv_events" not in _rec().to_json()  # absent unless set: a record reads as before
    assert decode(k, encode(_rec(kv_events=kv), KEY), KEY).kv_events == kv
    tampered = encode(_rec(kv_events=kv), KEY).replace("127.0.0.1:5", "10.6.6.6:5")
    assert pytest.raises(RegistrationRefused, decode, k, tampered, KEY).value.reason == "forged"
    for bad in ({"pub": "tcp://x:1"}, {**kv, "extra": "x"}, {**kv, "pub": 5}, {**kv, "replay": "r" * 300}):
        with pytest.raises(RegistrationRefused, match="record.kv_events: expected pub, replay and"):
            decode(k, encode(_rec(kv_events=bad), KEY), KEY)


def _cfg(cluster: dict, **top) -> dict:
    return {"model": MODEL, "router": {"port": 22110}, "disagg_cluster": cluster, "context_servers": {},
            "generation_servers": {}, **top}


def test_disagg_cluster_keys_are_validated_by_name():
    cfg = parse_config(_cfg({"cluster_name": "c1", "minimal_instances": {"context_servers": 2},
                             "heartbeat_interval_sec": 1, "inactive_interval_sec": 3}))
    cl = cfg.cluster
    assert (cl.uri, cl.name, cl.minimal, cl.heartbeat_s, cl.ttl_s) == \
        ("http://127.0.0.1:22110", "c1", (("context", 2), ("generation", 1)), 1.0, 3.0)
    assert cl.call_timeout_s == 0.5  # a heartbeat call's deadline is half the interval, never the interval
    assert parse_config(_cfg({"cluster_uri": "etcd://10.0.0.1:2379"})).cluster.scheme == "etcd"
    assert parse_config({k: v for k, v in _cfg({}).items() if k != "disagg_cluster"}).cluster is None
    bad = {"cluster_uri": ({"cluster_uri": "redis://x:1"}, "cluster_uri"),
           "ttl": ({"heartbeat_interval_sec": 5, "inactive_interval_sec": 6}, "at least twice"),
           "unknown": ({"cluster_uri": "etcd://x:1", "auth": 1}, "disagg_cluster.auth: unknown key"),
           "minimal": ({"minimal_instances": {"decode_servers": 1}}, "minimal_instances.decode_servers"),
           "name": ({"cluster_name": "a/b"}, "cluster_name")}
    for what, (d, msg) in bad.items():
        with pytest.raises(ServeConfigError, match=msg.replace(".", r"\.")):
            parse_config(_cfg(d))


TRTLLM = {"hostname": "127.0.0.1", "port": 22111, "model": MODEL, "backend": "pytorch",
          "disagg_cluster": {"cluster_uri": "http://127.0.0.1:22111", "cluster_name": "trt",
                             "minimal_instances": {"context_servers": 1, "generation_servers": 1},
                             "heartbeat_interval_sec": 1, "inactive_interval_sec": 3},
          "context_servers": {"num_instances": 1, "tensor_parallel_size": 1},
          "generation_servers": {"num_instances": 1, "tensor_parallel_size": 1}}


def test_serve_check_accepts_a_trtllm_serve_yaml_with_disagg_cluster(tmp_path):
    path = tmp_path / "trt.yaml"
    path.write_text(yaml.safe_dump(TRTLLM))
    r = subprocess.run([sys.executable, "-m", "kvbridge.cli", "serve", "--check", str(path)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "trtllm-serve disaggregated format" in r.stdout
    assert "disagg_cluster: workers join through http://127.0.0.1:22111 (cluster trt)" in r.stdout
    path.write_text(yaml.safe_dump({**TRTLLM, "disagg_cluster": {**TRTLLM["disagg_cluster"], "auth_token": 1}}))
    r = subprocess.run([sys.executable, "-m", "kvbridge.cli", "serve", "--check", str(path)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "disagg_cluster.auth_token: not supported by kvbridge" in r.stderr


def test_membership_refuses_forged_stale_and_insecure_records_by_name(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    cfg = parse_config(_cfg({"cluster_name": "c1", "heartbeat_interval_sec": 1, "inactive_interval_sec": 3}))

    async def body():
        m = RegistryWorkers(cfg)
        added = []

        async def on_added(w):
            added.append(w.name)

        await m.start(on_added)
        s, k = m.memory, worker_key("c1", "ctx-a")

        async def until(cond):
            t0 = time.monotonic()
            while not cond():
                assert time.monotonic() - t0 < 10, m.describe()
                await asyncio.sleep(0.02)

        try:
            with pytest.raises(ApiError) as e:
                m.admit()
            assert e.value.status == 503 and e.value.headers().get("Retry-After")
            await s.set(k, encode(_rec(started_ns=20, incarnation="ctx-a-2"), KEY), 3)
            await until(lambda: added == ["ctx-a"])
            refused = [("forged", encode(_rec(url="http://127.0.0.1:666"), registry_key("y" * 40, "c1"))),
                       ("stale_incarnation", encode(_rec(started_ns=10, incarnation="ctx-a-1"), KEY)),
                       ("insecure_url", encode(_rec(url="http://10.1.2.3:80", incarnation="ctx-a-3",
                                                    started_ns=30), KEY)),
                       ("wrong_model", encode(_rec(model="other", incarnation="ctx-a-4", started_ns=40), KEY))]
            for reason, v in refused:
                await s.set(k, v, 3)
                await until(lambda: m.refused and m.refused[-1]["reason"] == reason)
            assert [w.url for w in m.pool("context").workers] == ["http://127.0.0.1:9"]  # still the real one
            await s.set(k, encode(_rec(started_ns=50, incarnation="ctx-a-5", url="http://127.0.0.1:10"), KEY), 3)
            await until(lambda: [w.url for w in m.pool("context").workers] == ["http://127.0.0.1:10"])
            await s.set(k, encode(_rec(started_ns=60, incarnation="ctx-a-2"), KEY), 3)  # a replayed, retired one
            await until(lambda: "was replaced by a newer one" in m.refused[-1]["message"])
            assert [r["reason"] for r in m.describe()["refused"]][-1] == "stale_incarnation"
            await s.delete(k)
            await until(lambda: m.pool("context").workers == [])
        finally:
            await m.stop()

    _run(body())
