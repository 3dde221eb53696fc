"""vLLM servers join and leave a running deployment (`disagg_cluster`, the router as the registry): each
`kvbridge worker --name N` of an `engine: vllm` group starts a real vLLM server with KVBridgeConnector and
registers it once it serves (serving/vllm_member.py). While three client threads keep requests in flight: a
prefill and a decode server join an empty deployment; a second decode server joins and takes traffic; the
first leaves by SIGTERM (unregistered at once, drained: exit 0, not one request failed). Every answer equals
the prefill server's own (it computes and decodes alone). The decode servers bind beyond loopback, so every
call to them (the router's hops, streamed or not, /health, the drain) passes their members' guards."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time

import httpx
import openai
import pytest

from ..serving.cluster import TOKEN, start_process
from ..serving.members import Deployment
from .conftest import needs_vllm

pytestmark = [needs_vllm, pytest.mark.slow, pytest.mark.timeout(900)]
PROMPTS = [[(7 * k + 13 * n) % 500 + 3 for k in range(n)] for n in (40, 150, 300)]
MAX_TOKENS = 8


def _config() -> dict:
    return {"model": "tiny-llama", "startup_timeout_s": 600,
            "vllm": {"kv_connector": "KVBridgeConnector", "max_model_len": 1024, "cpus": "auto"},
            "router": {"port": 0, "request_timeout_s": 240, "health_interval_s": 1},
            "disagg_cluster": {"heartbeat_interval_sec": 1, "inactive_interval_sec": 4, "drain_timeout_sec": 60},
            "context_servers": {"engine": "vllm", "instances": 1},
            # bound beyond loopback: each decode server sits behind its member's guard (vllm_guard.py)
            "generation_servers": {"engine": "vllm", "instances": 2, "bind_host": "0.0.0.0"}}


class _Load:
    """Client threads sending the prompts one after another through the router until `stop`."""

    def __init__(self, router: str, n: int = 3) -> None:
        self.router, self.answers, self.errors = router, [], []
        self.stop, self.lock = threading.Event(), threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]

    def _run(self, i: int) -> None:
        with openai.OpenAI(base_url=self.router + "/v1", api_key="unused", timeout=240, max_retries=0) as c:
            k = i
            while not self.stop.is_set():
                k += 1
                p = k % len(PROMPTS)
                try:
                    if i == 2:  # one client streams: the decode server's chunks pass its guard one by one
                        text, who = self._streamed(c, p)
                    else:
                        out = c.completions.create(model="tiny-llama", prompt=PROMPTS[p],
                                                   max_tokens=MAX_TOKENS, temperature=0)
                        text, who = out.choices[0].text, out.model_extra["kvbridge"]["generation_worker"]
                except openai.APIError as e:
                    with self.lock:
                        self.errors.append(str(e)[:300])
                    time.sleep(0.2)
                    continue
                with self.lock:
                    self.answers.append((p, text, who))

    @staticmethod
    def _streamed(c: openai.OpenAI, p: int) -> tuple[str, str]:
        text, who = "", ""
        for chunk in c.completions.create(model="tiny-llama", prompt=PROMPTS[p], max_tokens=MAX_TOKENS,
                                          temperature=0, stream=True):
            text += chunk.choices[0].text if chunk.choices else ""
            who = (chunk.model_extra or {}).get("kvbridge", {}).get("generation_worker", who)
        return text, who

    def wait_answers(self, n: int, who: str | None = None, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        start = self.count(who)
        while self.count(who) - start < n:
            assert time.monotonic() < deadline, f"fewer than {n} answers{' from ' + who if who else ''}"
            time.sleep(0.2)

    def count(self, who: str | None = None) -> int:
        with self.lock:
            return sum(1 for a in self.answers if who is None or a[2] == who)


def _check_guard(url: str) -> None:
    """A decode server bound beyond loopback answers only through its guard: the routes vLLM leaves open
    (/invocations runs completions, /tokenize) refuse a caller without the deployment's token, /health tells
    it only the status; with the token (what the router sends) vLLM answers."""
    body = {"model": "tiny-llama", "prompt": PROMPTS[0], "max_tokens": 2}
    for path in ("/invocations", "/tokenize", "/v1/completions"):
        r = httpx.post(url + path, json=body, timeout=30)
        assert r.status_code == 401 and "X-KVBridge-Token" in r.text, (path, r.status_code, r.text[:200])
    assert httpx.get(url + "/metrics", timeout=30).status_code == 401
    r = httpx.get(url + "/health", timeout=30)
    assert r.status_code == 200 and r.content == b""
    r = httpx.post(url + "/tokenize", json={"model": "tiny-llama", "prompt": "hello"},
                   headers={"X-KVBridge-Token": TOKEN, "Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert r.status_code == 200 and r.json()["tokens"], r.text[:200]


def test_vllm_servers_join_take_traffic_and_leave_by_sigterm_losing_no_request(tiny_model, tmp_path, monkeypatch):
    # where the members keep their vLLM servers' output; short: vLLM binds its ZeroMQ ipc sockets under TMPDIR,
    # and a path past 107 bytes (tmp_path under a pytest-xdist worker's folder) cannot be bound
    short = tempfile.mkdtemp(prefix="kvb-")
    monkeypatch.setenv("TMPDIR", short)
    dep = Deployment(tmp_path, _config())
    load = None
    try:
        def member(role: str, name: str, index: int):
            dep.procs[name] = start_process(["worker", "--config", dep.worker_config, "--role", role, "--index",
                                             str(index), "--name", name], dep.log(name))

        assert dep.members() == {}
        member("context", "p-a", 0)
        member("generation", "d-a", 0)
        dep.wait_healthy("p-a", "d-a", timeout=400)
        alone = openai.OpenAI(base_url=dep.url("p-a") + "/v1", api_key=TOKEN, timeout=240)
        want = [alone.completions.create(model="tiny-llama", prompt=p, max_tokens=MAX_TOKENS, temperature=0)
                .choices[0].text for p in PROMPTS]
        load = _Load(dep.router)
        for t in load.threads:
            t.start()
        load.wait_answers(6)

        member("generation", "d-b", 1)  # joins while the others serve
        dep.wait_healthy("d-b", timeout=400)
        load.wait_answers(2, "d-b")
        _check_guard(dep.url("d-b"))

        dep.procs["d-a"].terminate()  # leaves: unregistered at once, drained, exit 0
        dep.wait(lambda b: "d-a" not in b["cluster"]["workers"], "d-a unregistered", 30)
        assert dep.procs["d-a"].wait(120) == 0, dep.tail("d-a")
        assert "drained in" in dep.tail("d-a")
        after = load.count("d-b")
        load.wait_answers(4)
        assert load.count("d-b") - after >= 4 and load.count("d-a") >= 1
    finally:
        if load is not None:
            load.stop.set()
            for t in load.threads:
                t.join(240)
        dep.stop()
        shutil.rmtree(short, ignore_errors=True)
    assert load.errors == [], load.errors[:3]
    wrong = [a for a in load.answers if a[1] != want[a[0]]]
    assert not wrong, f"{len(wrong)} of {len(load.answers)} answers differ from the prefill server's own: {wrong[:2]}"
