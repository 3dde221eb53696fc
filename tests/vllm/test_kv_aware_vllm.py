"""`policy: kv_aware` over real vLLM servers: each `kvbridge worker` of an `engine: vllm` group relays its
server's own KV events (serving/vllm_kv_relay.py), signed, and the router routes by them.

Two prefill servers and one decode server join a deployment whose router is the registry, speculative
entries off (`spec_ttl_s: 0`: only the servers' own events count). For three kinds of prompt in turn (token
ids, text, chat messages: the router has text and chats tokenized by vLLM's own /tokenize): one is routed;
once that server's relayed blocks reach the router's index, a second prompt sharing the prefix goes to the
same server, the decision names the prefix's whole blocks as held there and nowhere else, and vLLM's own
prefix-cache counter on that server rises by at least those tokens (the KV the router counted on was really
there). Then the server holding the last prefix leaves by SIGTERM: its blocks leave the index, and the prompt
goes to the other. Every answer equals that other server's own (it computes and decodes alone).
The deployment speaks HTTPS (`tls:`, test certificates made with openssl; plain HTTP where it is missing):
each vLLM server sits behind its member's guard, the TLS end, so every call of the router (hops, /tokenize,
/health), of the registration and of this test reaches vLLM through TLS and the deployment's token.
"""
from __future__ import annotations

import random
import shutil
import tempfile
import time

import httpx
import openai
import pytest

from kvbridge.bench.common import metric_by, metric_sum

from kvbridge.serving.auth import TOKEN_HEADER

from ..serving.cluster import TOKEN, start_process
from ..serving.members import Deployment
from ..serving.tls_certs import make_certs, openssl_missing
from .conftest import needs_vllm

pytestmark = [needs_vllm, pytest.mark.slow, pytest.mark.timeout(900)]
BLOCK = 128  # vLLM's default on CPU, which the relay passes to it explicitly
MAX_TOKENS = 6


def _prompt(seed: int, n: int) -> list[int]:
    return [(7 * k + 13 * seed * seed + 5) % 500 + 3 for k in range(n)]


def _config() -> dict:
    return {"model": "tiny-llama", "startup_timeout_s": 600,
            "vllm": {"kv_connector": "KVBridgeConnector", "max_model_len": 1024, "cpus": "auto"},
            "router": {"port": 0, "request_timeout_s": 240, "health_interval_s": 1, "policy": "kv_aware",
                       "kv_aware": {"spec_ttl_s": 0}},
            "disagg_cluster": {"heartbeat_interval_sec": 1, "inactive_interval_sec": 4,
                               "drain_timeout_sec": 60},
            "context_servers": {"engine": "vllm", "instances": 2},
            "generation_servers": {"engine": "vllm", "instances": 1}}


def _words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    words = ("river", "stone", "light", "paper", "north", "seven", "glass", "quiet", "amber", "field")
    return " ".join(rng.choice(words) + str(rng.randrange(100)) for _ in range(n))


def _pairs() -> list[tuple[dict, dict]]:
    """(first, second) requests sharing a long prefix: token ids, text, and chat messages (a long system
    message: vLLM's chat template renders both the same up to the user's turn)."""
    ids = _prompt(1, 3 * BLOCK + 20)
    text = _words(2, 120)
    system = {"role": "system", "content": _words(3, 110)}
    return [({"prompt": ids}, {"prompt": ids[:3 * BLOCK] + _prompt(11, 30)}),
            ({"prompt": text}, {"prompt": text + " " + _words(12, 8)}),
            ({"messages": [system, {"role": "user", "content": _words(4, 6)}]},
             {"messages": [system, {"role": "user", "content": _words(13, 9)}]})]


HEADERS = {"Authorization": f"Bearer {TOKEN}", TOKEN_HEADER: TOKEN}  # vLLM's api key, and its guard's token
VERIFY: dict = {0: True}  # the test's trust: the deployment's CA once its certificates are made


def _tokenize(url: str, req: dict) -> list[int]:
    """The request's prompt as that vLLM server tokenizes it (its own /tokenize; token ids as they are)."""
    if isinstance(req.get("prompt"), list):
        return req["prompt"]
    r = httpx.post(url + "/tokenize", json={"model": "tiny-llama", **req}, headers=HEADERS, verify=VERIFY[0],
                   timeout=30)
    assert r.status_code == 200, r.text[:500]
    return r.json()["tokens"]


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _index_blocks(router: str) -> dict[str, float]:
    return metric_by(httpx.get(router + "/metrics", verify=VERIFY[0], timeout=10).text,
                     "kvbridge_router_kv_index_blocks", "worker")


def _prefix_hits(url: str) -> float:
    """vLLM's vllm:prefix_cache_hits_total (tokens served from its prefix cache)."""
    return metric_sum(httpx.get(url + "/metrics", headers=HEADERS, verify=VERIFY[0], timeout=10).text,
                      "vllm:prefix_cache_hits_total")


def _wait(cond, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
        time.sleep(0.2)


def test_kv_aware_routes_vllm_prompts_to_the_server_holding_their_prefix(tiny_model, tmp_path, monkeypatch):
    short = tempfile.mkdtemp(prefix="kvb-")  # vLLM's ipc sockets live under TMPDIR: keep the path short
    monkeypatch.setenv("TMPDIR", short)
    cfg = _config()
    if not openssl_missing():
        certs = make_certs(str(tmp_path / "certs"))
        cfg["tls"] = certs.tls()
        monkeypatch.setitem(VERIFY, 0, certs.trust())
    dep = Deployment(tmp_path, cfg, verify=VERIFY[0])
    try:
        for role, name, index in (("context", "p-a", 0), ("context", "p-b", 1), ("generation", "d-a", 0)):
            dep.procs[name] = start_process(["worker", "--config", dep.worker_config, "--role", role,
                                             "--index", str(index), "--name", name], dep.log(name))
        dep.wait_healthy("p-a", "p-b", "d-a", timeout=400)
        _wait(lambda: set(_index_blocks(dep.router)) >= {"p-a", "p-b", "d-a"}, "the router follows all three")
        urls = {n: dep.url(n) for n in ("p-a", "p-b")}
        assert all(u.startswith("https://" if "tls" in cfg else "http://") for u in urls.values()), urls
        http = httpx.Client(verify=VERIFY[0], timeout=240)
        client = openai.OpenAI(base_url=dep.router + "/v1", api_key="unused", http_client=http, timeout=240,
                               max_retries=0)
        answers: list[tuple[dict, str]] = []

        def ask(req: dict) -> dict:
            if "messages" in req:
                out = client.chat.completions.create(model="tiny-llama", max_tokens=MAX_TOKENS, temperature=0,
                                                     **req)
                text = out.choices[0].message.content
            else:
                out = client.completions.create(model="tiny-llama", max_tokens=MAX_TOKENS, temperature=0,
                                                **req)
                text = out.choices[0].text
            answers.append((req, text))
            return out.model_extra["kvbridge"]

        for first, second in _pairs():  # token ids, text, chat messages: each pair shares a prefix
            shared = _common(_tokenize(urls["p-a"], first), _tokenize(urls["p-a"], second))
            want_hit = BLOCK * (shared // BLOCK)
            assert want_hit >= 2 * BLOCK, want_hit
            before = _index_blocks(dep.router)
            held = ask(first)["route"]["context"]["worker"]
            other = ({"p-a", "p-b"} - {held}).pop()
            _wait(lambda: _index_blocks(dep.router).get(held, 0) >= before[held] + want_hit // BLOCK,
                  f"{held}'s blocks indexed")
            hits0 = _prefix_hits(urls[held])
            got = ask(second)
            ctx = got["route"]["context"]
            assert ctx["worker"] == held and got["context_worker"] == held, got
            assert ctx["hit_tokens"] == want_hit, (list(first), ctx)  # the router keyed it as vLLM did
            assert ctx["candidates"][other]["hit_tokens"] == 0, ctx
            assert _prefix_hits(urls[held]) - hits0 >= want_hit, "the router counted on KV vLLM did not use"

        dep.procs[held].terminate()  # leaves: its blocks leave the index, its prompt goes to the other
        dep.wait(lambda b: held not in b["cluster"]["workers"], f"{held} unregistered", 60)
        assert dep.procs[held].wait(120) == 0, dep.tail(held)
        _wait(lambda: held not in _index_blocks(dep.router), f"{held} out of the index")
        got = ask(second)
        assert got["route"]["context"]["worker"] == other and got["route"]["context"]["hit_tokens"] == 0, got
        # every answer equals the remaining prefill server's own (asked last: its cache took no part above)
        alone = openai.OpenAI(base_url=urls[other] + "/v1", api_key=TOKEN, default_headers={TOKEN_HEADER: TOKEN},
                              http_client=http, timeout=240, max_retries=0)
        for req, text in answers:
            if "messages" in req:
                want = alone.chat.completions.create(model="tiny-llama", max_tokens=MAX_TOKENS, temperature=0,
                                                     **req).choices[0].message.content
            else:
                want = alone.completions.create(model="tiny-llama", max_tokens=MAX_TOKENS, temperature=0,
                                                **req).choices[0].text
            assert text == want, f"{list(req)}: {text!r} through the router, {want!r} alone"
    finally:
        dep.stop()
        shutil.rmtree(short, ignore_errors=True)
    assert "Traceback" not in dep.router_log()
