"""Workers join and leave a serving deployment under load, through both registries that really run: the
router's own (http://) and a real etcd server started here (etcd://).

32 client threads (a quarter of them streaming) keep >= 32 requests in flight through the official `openai`
client while: a context and a
generation worker join (each takes traffic within one heartbeat interval of the router seeing it); a
generation worker leaves by SIGTERM (it unregisters and drains: 0 failed requests in that phase); a context
worker is killed by kill -9 (only retryable errors, each request rerun by the client until it succeeds); and,
on etcd, etcd itself is stopped for 10 s (service goes on on the last membership, /health and
kvbridge_router_registry_up say so, and the registry is watched again once etcd is back), and a second router on the same etcd sees the same workers and answers exactly. Afterwards: 0 hung
(every thread ended within its deadline), 0 lost (every request answered), every answer equal to the
aggregated reference, the positional KV check on every answer whose two workers are still up, and every
pool of the remaining workers full again."""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field

import httpx
import openai
import pytest

from .cluster import PROMPTS, start_announced, stop_process, wait_pool_full
from .conftest import MAX_TOKENS
from .etcd_server import EtcdServer
from .kvcheck import assert_kv_positional
from .members import BLOCKS, Deployment, cluster_config

pytestmark = pytest.mark.slow

CLIENTS = 32
HEARTBEAT_S = 2.0
RETRYABLE = (502, 503, 504)


@dataclass
class Load:
    """CLIENTS threads, each sending one request after another until `stop`; every answer and every error is
    recorded with the phase it happened in."""

    router: str
    phase: str = "steady"
    answers: list = field(default_factory=list)   # (phase, prompt index, tokens, ctx, gen, handle, sent_at)
    errors: list = field(default_factory=list)    # (phase, status or exception name, message)
    fatal: list = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, i: int) -> None:
        with openai.OpenAI(base_url=self.router + "/v1", api_key="unused", timeout=120, max_retries=0) as oc:
            n = i
            while not self.stop.is_set():
                n += 1
                self.one(oc, n % len(PROMPTS), stream=i % 4 == 0)  # a quarter of the clients stream

    def one(self, oc, k: int, stream: bool) -> None:
        for _ in range(8):  # a retryable failure is rerun; anything else fails the test
            sent = time.monotonic()
            try:
                kb = _ask(oc, k, stream)
            except openai.APIStatusError as e:
                with self.lock:
                    self.errors.append((self.phase, e.status_code, str(e)[:300]))
                if e.status_code not in RETRYABLE:
                    self.fatal.append(str(e)[:500])
                    return
                time.sleep(0.2)
                continue
            except openai.APIConnectionError as e:
                with self.lock:
                    self.errors.append((self.phase, type(e).__name__, str(e)[:300]))
                time.sleep(0.2)
                continue
            except openai.APIError as e:  # a stream that failed after it started (its last event: an error)
                with self.lock:
                    self.errors.append((self.phase, "stream_error", str(e)[:300]))
                time.sleep(0.2)
                continue
            with self.lock:
                self.answers.append((self.phase, k, kb["token_ids"], kb["context_worker"],
                                     kb["generation_worker"], kb["handle"], sent))
            return
        self.fatal.append(f"prompt {k}: still failing after 8 tries")

    def count(self, phase: str | None = None) -> int:
        with self.lock:
            return sum(1 for a in self.answers if phase is None or a[0] == phase)

    def wait_answers(self, n: int, timeout: float = 120) -> None:
        deadline, start = time.monotonic() + timeout, self.count()
        while self.count() - start < n:
            assert not self.fatal, self.fatal[:3]
            assert time.monotonic() < deadline, f"fewer than {n} answers in {timeout}s"
            time.sleep(0.1)


def _ask(oc, k: int, stream: bool) -> dict:
    """One completion of PROMPTS[k]: its `kvbridge` object (a stream's token ids joined, its last names)."""
    if not stream:
        return oc.completions.create(model="seeded:tiny3", prompt=PROMPTS[k], max_tokens=MAX_TOKENS,
                                     temperature=0).model_extra["kvbridge"]
    kb: dict = {"token_ids": []}
    for chunk in oc.completions.create(model="seeded:tiny3", prompt=PROMPTS[k], max_tokens=MAX_TOKENS,
                                       temperature=0, stream=True):
        extra = (chunk.model_extra or {}).get("kvbridge") or {}
        kb["token_ids"] += extra.get("token_ids", [])
        kb.update({x: extra[x] for x in ("context_worker", "generation_worker", "handle") if x in extra})
    missing = [x for x in ("context_worker", "generation_worker", "handle") if x not in kb]
    assert not missing, f"a stream ended without {missing}: {kb}"
    return kb


def _first_sent_to(load: Load, name: str, after: float, timeout: float = 60) -> float:
    deadline = time.monotonic() + timeout
    while True:
        with load.lock:
            sent = [a[6] for a in load.answers if name in (a[3], a[4]) and a[6] >= after]
        if sent:
            return min(sent)
        assert time.monotonic() < deadline, f"{name} took no traffic within {timeout}s"
        time.sleep(0.1)


def _registry_up(router: str) -> float:
    text = httpx.get(router + "/metrics", timeout=10).text
    return float(re.search(r"^kvbridge_router_registry_up (\S+)$", text, re.MULTILINE).group(1))


@pytest.mark.parametrize("backend", ["http", "etcd"])
def test_workers_join_drain_and_die_under_load_with_every_answer_exact(backend, tmp_path, want):
    etcd = EtcdServer(str(tmp_path / "etcd"), str(tmp_path / "etcd.log")).start() if backend == "etcd" else None
    dep = None
    threads: list[threading.Thread] = []
    load = None
    try:
        dep = Deployment(tmp_path, cluster_config(etcd.uri if etcd else None, heartbeat_s=HEARTBEAT_S, ttl_s=6))
        dep.start_worker("context", "ctx-a")
        dep.start_worker("generation", "gen-a")
        dep.wait_healthy("ctx-a", "gen-a")
        load = Load(dep.router)
        threads = [threading.Thread(target=load.run, args=(i,), daemon=True) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        load.wait_answers(24)

        # join: each new worker takes traffic within one heartbeat interval of the router seeing it
        load.phase = "join"
        dep.start_worker("context", "ctx-b")
        dep.start_worker("generation", "gen-b")
        joined = {}
        for name in ("ctx-b", "gen-b"):
            dep.wait(lambda b: name in b["cluster"]["workers"], f"{name} registered")
            seen = time.monotonic()
            joined[name] = _first_sent_to(load, name, seen - 0.05) - seen
        assert all(dt < HEARTBEAT_S for dt in joined.values()), joined
        load.wait_answers(24)

        # leave by SIGTERM: unregistered at once, in-flight requests drained, not one failure
        load.phase = "drain"
        dep.procs["gen-a"].terminate()
        dep.wait(lambda b: "gen-a" not in b["cluster"]["workers"], "gen-a unregistered", 30)
        assert dep.procs["gen-a"].wait(60) == 0, dep.tail("gen-a")
        assert "drained in" in dep.tail("gen-a")
        load.wait_answers(24)
        assert [e for e in load.errors if e[0] == "drain"] == []

        # kill -9: only retryable errors, every request rerun until answered
        load.phase = "kill"
        dep.kill9("ctx-a")
        dep.wait(lambda b: "ctx-a" not in b["cluster"]["workers"], "ctx-a's lease ran out", 60)
        load.wait_answers(24)
        load.phase = "after_kill"
        load.wait_answers(20)

        if etcd is not None:  # etcd down for 10 s: the last membership serves, and says so
            load.phase = "etcd_down"
            etcd.stop()
            t0 = time.monotonic()
            body = dep.wait(lambda b: b["cluster"]["registry"] == "unreachable", "the outage seen", 30)
            assert set(body["cluster"]["workers"]) == {"ctx-b", "gen-b"} and body["status"] == "ok"
            assert _registry_up(dep.router) == 0.0
            before = load.count()
            time.sleep(max(0.0, 10 - (time.monotonic() - t0)))
            assert load.count() - before >= 10, "service stalled while etcd was down"
            etcd.start()
            load.phase = "etcd_back"
            body = dep.wait(lambda b: b["cluster"]["registry"] == "ok", "the registry watched again", 60)
            assert set(body["cluster"]["workers"]) == {"ctx-b", "gen-b"}
            assert _registry_up(dep.router) == 1.0
            load.wait_answers(24)
            assert [e for e in load.errors if e[0] in ("etcd_down", "etcd_back")] == []
            _second_router_sees_the_same_workers(tmp_path, want)
    finally:
        if load is not None:
            load.stop.set()
        deadline = time.monotonic() + 180
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        hung = sum(t.is_alive() for t in threads)
        try:
            if dep is not None and not hung and load is not None and not load.fatal:
                _check_after(dep, load, want)
        finally:
            if dep is not None:
                dep.stop()
            if etcd is not None:
                etcd.stop()
    assert hung == 0, f"{hung} client threads still waiting"
    assert not load.fatal, load.fatal[:3]
    bad = [e for e in load.errors if e[0] not in ("kill",) and e[0] != "after_kill"]
    assert bad == [], bad[:5]
    assert all(e[1] in RETRYABLE or e[1] in ("APIConnectionError", "APITimeoutError", "stream_error")
               for e in load.errors)
    print(f"\n{backend}: {len(load.answers)} answers, {len(load.errors)} retryable errors (kill -9 phase), "
          f"joined -> first request (s): { {k: round(v, 3) for k, v in joined.items()} }")


def _second_router_sees_the_same_workers(tmp_path, want) -> None:
    """Another router on the same etcd: the same members, and an exact answer through it."""
    p, url = start_announced(["router", "--config", str(tmp_path / "router.yaml")], str(tmp_path / "router2.log"),
                             timeout=120)
    try:
        deadline = time.monotonic() + 60
        while True:
            w = httpx.get(url + "/health", timeout=10).json()["cluster"]["workers"]
            if set(w) == {"ctx-b", "gen-b"} and all(x["healthy"] for x in w.values()):
                break
            assert time.monotonic() < deadline, w
            time.sleep(0.2)
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=120, max_retries=0) as oc:
            out = oc.completions.create(model="seeded:tiny3", prompt=PROMPTS[2], max_tokens=MAX_TOKENS,
                                        temperature=0)
        assert out.model_extra["kvbridge"]["token_ids"] == want["prompts"][2]
    finally:
        stop_process(p)


def _check_after(dep: Deployment, load: Load, want) -> None:
    wrong = [a for a in load.answers if a[2] != want["prompts"][a[1]]]
    assert not wrong, f"{len(wrong)} answers differ from the aggregated reference, e.g. {wrong[0][:5]}"
    alive = {n: dep.url(n) for n in ("ctx-b", "gen-b")}
    pairs = [a for a in load.answers if a[3] == "ctx-b" and a[4] == "gen-b"]
    assert len(pairs) >= 10
    assert assert_kv_positional(alive["ctx-b"], alive["gen-b"], [a[5] for a in pairs[-24:]]) >= 10
    for n, url in alive.items():
        assert wait_pool_full(url, BLOCKS, 1) == [BLOCKS], n
    m = re.search(r"^kvbridge_router_retries_total (\S+)$", httpx.get(dep.router + "/metrics", timeout=10).text, re.MULTILINE)
    print(f"\nrouter reruns and retries (kvbridge_router_retries_total): {m.group(1) if m else '?'}")
