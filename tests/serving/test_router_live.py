"""The router of a live deployment (real processes, tcp agent): in-flight counts back to 0 on every path,
a refusal after prefill frees the context KV at once, no prefill without a healthy generation worker,
fan-out features (n, a list of prompts, echo, text parts) with exact tokens, and generated bodies of every
kind never getting a 5xx or killing a worker."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .cluster import HEADERS, MODEL, PATIENT, PROMPTS, launch, sse_events, streamed_tokens, wait_pool_full
from .conftest import CHAT, MAX_TOKENS

CTX_BLOCKS, GEN_BLOCKS, TPB = 64, 24, 4  # the generation pool holds 96 tokens: longer requests are refused
CFG = {
    "model": MODEL,
    "executor": {"num_blocks": CTX_BLOCKS, "tokens_per_block": TPB, "threads_per_rank": 1, "timeout_s": 120},
    "transceiver": {"agent": "tcp", "handshake_timeout_s": 3, **PATIENT},
    "router": {"port": 0, "policy": "least_loaded", "request_timeout_s": 120},
    "context_servers": {"tp": 1},
    "generation_servers": {"tp": 1, "executor": {"num_blocks": GEN_BLOCKS}},
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = launch(CFG, str(tmp_path_factory.mktemp("logs")))
    yield c
    c.stop()


@pytest.fixture(scope="module")
def urls(cluster):
    return {"router": cluster.router_url, "ctx": cluster.cfg.context[0].url,
            "gen": cluster.cfg.generation[0].url}


def _in_flight(router: str) -> dict[str, float]:
    text = httpx.get(router + "/metrics", timeout=10).text
    return {m[0]: float(m[1]) for m in re.findall(r'kvbridge_router_worker_in_flight\{worker="(\w+)"\} (\S+)',
                                                    text)}


def _wait_in_flight_zero(router: str, timeout: float = 30) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        got = _in_flight(router)
        if all(v == 0 for v in got.values()) or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def _pools_full(urls) -> None:
    assert wait_pool_full(urls["ctx"], CTX_BLOCKS, 1) == [CTX_BLOCKS]
    assert wait_pool_full(urls["gen"], GEN_BLOCKS, 1) == [GEN_BLOCKS]


def test_in_flight_returns_to_zero_after_success_error_disconnect_and_streaming(urls, want):
    router = urls["router"]
    body = {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0}
    r = httpx.post(router + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["kvbridge"]["token_ids"] == want["prompts"][0]
    assert _in_flight(router) == {"ctx0": 0, "gen0": 0}  # non-streamed success: nothing left counted
    r = httpx.post(router + "/v1/completions", json={**body, "prompt": [1, 999]}, timeout=120)
    assert r.status_code == 400 and "999" in r.json()["error"]["message"]
    assert _in_flight(router) == {"ctx0": 0, "gen0": 0}
    with httpx.stream("POST", router + "/v1/completions", json={**body, "stream": True}, timeout=120) as s:
        events = sse_events(s)
    assert streamed_tokens(events) == want["prompts"][0] and events[-1] == "[DONE]"
    with httpx.stream("POST", router + "/v1/completions", timeout=120,
                      json={**body, "max_tokens": 30, "stream": True}) as s:
        next(line for line in s.iter_lines() if line.startswith("data:"))  # then the client goes away
    assert _wait_in_flight_zero(router) == {"ctx0": 0, "gen0": 0}
    _pools_full(urls)


def test_a_refusal_after_prefill_frees_the_context_kv_at_once(urls):
    """The generation pool (96 tokens) cannot hold a 20-token text prompt + 90 (the router cannot know the
    text's length before the prefill); the context KV is dropped on the refusal, not after pickup_timeout_s
    (120 s by default). What the router does know (max_tokens, a token-id prompt) is refused before it."""
    r = httpx.post(urls["router"] + "/v1/completions", timeout=120,
                   json={"prompt": "twenty characters...", "max_tokens": 90, "temperature": 0})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("generation worker"), r.text
    assert wait_pool_full(urls["ctx"], CTX_BLOCKS, 1, timeout=5) == [CTX_BLOCKS]
    assert httpx.get(urls["ctx"] + "/health", headers=HEADERS, timeout=10).json()["pinned_context_requests"] == 0
    r = httpx.post(urls["router"] + "/v1/completions", timeout=120,
                   json={"prompt": PROMPTS[0], "max_tokens": 90, "temperature": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert "generation worker gen0 holds 96" in r.json()["error"]["message"]


def test_a_worker_answers_bad_bodies_with_json_and_keeps_the_connection(urls, want):
    """Straight to the workers (no router in front): NaN, 5,000-deep nesting, seed=2**64, top_p=0 and a
    tiny temperature fail that request alone, as JSON; the next request on the same connection is served."""
    good = {"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0}
    bad = [b'{"prompt": "x", "temperature": NaN}', b"[" * 5000 + b"]" * 5000,
           json.dumps({"prompt": "x", "seed": 2**64}).encode(),
           json.dumps({"prompt": "x", "top_p": 0}).encode()]
    with httpx.Client(base_url=urls["gen"], headers=HEADERS, timeout=60) as c:
        for raw in bad:
            r = c.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400 and "error" in r.json(), r.text
        for extreme in ({"temperature": 1e-40}, {"temperature": 1.0, "top_p": 1e-30, "seed": 2**63 - 1}):
            r = c.post("/v1/completions", json={**good, **extreme})
            assert r.status_code == 200 and r.json()["kvbridge"]["token_ids"] == want["prompts"][1], r.text
        assert c.get("/health").status_code == 200


def test_the_release_endpoint_refuses_what_is_not_ours(urls):
    r = httpx.post(urls["ctx"] + "/internal/release", headers=HEADERS, json={"disaggregated_params": {"request_type": "x"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "disaggregated_params"
    r = httpx.post(urls["ctx"] + "/internal/release", headers=HEADERS, content=b"[[[[")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_n_a_list_of_prompts_echo_and_text_parts_give_the_aggregated_tokens(urls, want):
    v1 = urls["router"] + "/v1"
    r = httpx.post(v1 + "/completions", timeout=120,
                   json={"prompt": PROMPTS[:2], "n": 2, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    got = [kb["token_ids"] for kb in out["kvbridge"]["choices"]]
    assert got == [want["prompts"][0]] * 2 + [want["prompts"][1]] * 2
    assert out["usage"]["prompt_tokens"] == len(PROMPTS[0]) + len(PROMPTS[1])
    assert out["usage"]["completion_tokens"] == 4 * MAX_TOKENS
    r = httpx.post(v1 + "/completions", timeout=120,
                   json={"prompt": "Once upon", "echo": True, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("Once upon")
    parts = [{**m, "content": [{"type": "text", "text": m["content"][:3]},
                               {"type": "text", "text": m["content"][3:]}]} for m in CHAT]
    r = httpx.post(v1 + "/chat/completions", timeout=120,
                   json={"messages": parts, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200 and r.json()["kvbridge"]["token_ids"] == want["chat"]
    body = {"prompt": PROMPTS[2], "n": 2, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", v1 + "/completions", json=body, timeout=120) as s:
        events = sse_events(s)
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 2 * MAX_TOKENS
    for i in (0, 1):
        mine = [t for e in events[:-2] if e["choices"][0]["index"] == i for t in e["kvbridge"]["token_ids"]]
        assert mine == want["prompts"][2]
    _pools_full(urls)


def test_no_generation_worker_healthy_means_503_before_any_prefill(cluster, urls):
    from kvbridge.serving.config import parse_config
    from kvbridge.serving.router import Router

    cfg = parse_config({**CFG, "context_servers": {"tp": 1, "urls": [urls["ctx"].removeprefix("http://")]},
                        "generation_servers": {"urls": ["127.0.0.1:9"]}})
    from fastapi.testclient import TestClient

    with TestClient(Router(cfg).app) as client:
        r = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 2})
    assert r.status_code == 503 and r.headers["retry-after"] == "2"
    assert r.json()["error"]["code"] == "no_generation_worker"
    assert httpx.get(urls["ctx"] + "/health", headers=HEADERS, timeout=10).json()["pinned_context_requests"] == 0


def _peak_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def test_six_concurrent_60_mib_bodies_are_refused_without_taking_the_router_to_1_gb(cluster, urls):
    """Bodies are counted as they arrive (max_inflight_body_bytes, 128 MiB by default): two fit, the others
    get 503 + Retry-After before they are whole; a whole one is a 400 (prompt too long), never forwarded."""
    body = b'{"max_tokens": 1, "prompt": "' + b"ab" * (30 << 20) + b'"}'

    def post(_):
        try:
            r = httpx.post(urls["router"] + "/v1/completions", content=body, timeout=120,
                           headers={"content-type": "application/json"})
            return r.status_code, r.headers.get("retry-after"), r.json()["error"]
        except httpx.TransportError as e:  # the router may answer 503 before it read the whole body
            return 0, None, {"message": repr(e)}

    from concurrent.futures import ThreadPoolExecutor

    busy = 'kvbridge_router_requests_total{endpoint="completions",status="503"} '

    def refused() -> float:
        text = httpx.get(urls["router"] + "/metrics", timeout=10).text
        return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(busy)), 0.0)

    before = refused()
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(post, range(6)))
    assert all(s in (0, 400, 503) for s, _, _ in got), got
    assert all(ra == "1" for s, ra, _ in got if s == 503)
    assert refused() - before >= 2, [(s, e["message"][:80]) for s, _, e in got]  # 2 fit, 4 do not
    assert all(e.get("param") == "prompt" for s, _, e in got if s == 400)
    router = next(c for c in cluster.children if c.name == "router")
    assert _peak_rss_bytes(router.proc.pid) < 1 << 30


def _num():
    return st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-2**70, 2**70),
                     st.sampled_from([0, 1, 1e-40, 0.5, 2, -1]), st.text(max_size=3), st.none(),
                     st.booleans())


_FIELDS = {
    "prompt": st.one_of(st.text(max_size=40), st.lists(st.integers(-5, 300), max_size=20),
                        st.lists(st.text(min_size=1, max_size=8), max_size=3), st.integers(), st.none()),
    "max_tokens": st.one_of(st.integers(1, 4), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=2)),
    "temperature": _num(), "top_p": _num(), "top_k": _num(), "seed": _num(),
    "n": st.one_of(st.integers(1, 2), st.integers(-3, 2**65)), "stream": st.one_of(st.booleans(), _num()),
    "echo": st.booleans(), "best_of": st.integers(-1, 3), "stop": st.one_of(st.text(max_size=3), st.none()),
    "logprobs": st.one_of(st.integers(-1, 3), st.none()), "response_format": st.one_of(
        st.just({"type": "text"}), st.just({"type": "json_object"}), st.text(max_size=3)),
    "stream_options": st.one_of(st.just({"include_usage": True}), st.text(max_size=2)),
    "model": st.one_of(st.just(MODEL), st.text(max_size=5)),
}


def _deep(n: int) -> str:
    return "[" * n + "]" * n


_bodies = st.one_of(
    st.fixed_dictionaries({"prompt": st.just("hi"), "max_tokens": st.integers(1, 3)},
                          optional={k: v for k, v in _FIELDS.items() if k not in ("prompt", "max_tokens")}),
    st.dictionaries(st.sampled_from(sorted(_FIELDS)), st.just(None), max_size=6).flatmap(
        lambda d: st.fixed_dictionaries({k: _FIELDS[k] for k in d})),
    st.integers(1, 6000).map(lambda n: '{"prompt": "x", "max_tokens": 2, "stop": ' + _deep(n) + "}"),
    st.sampled_from(['{"prompt": "x", "temperature": NaN}', '[1, 2]', '"x"', '{"prompt": "x"', "",
                     '{"prompt": "' + "a" * 200000 + '", "max_tokens": 1}']),
)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=_bodies)
def _one_generated_body_never_gets_a_5xx(urls, body):
    raw = body if isinstance(body, str) else json.dumps(body, allow_nan=True)
    with httpx.stream("POST", urls["router"] + "/v1/completions", content=raw.encode(), timeout=120,
                      headers={"content-type": "application/json"}) as r:
        text = r.read().decode()
        assert r.status_code < 500, (r.status_code, text[:500], raw[:300])
        if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
            assert text.rstrip().endswith("data: [DONE]"), text[-500:]
        else:
            json.loads(text)  # always JSON, never plain text


@pytest.mark.slow
def test_generated_bodies_never_get_a_5xx_nor_kill_a_worker_and_the_pools_end_full(urls):
    _one_generated_body_never_gets_a_5xx(urls)  # 150 generated bodies (one test: order-proof)
    for u in (urls["ctx"], urls["gen"], urls["router"]):
        assert httpx.get(u + "/health", timeout=10).status_code == 200
    # a worker no request reached has no in-flight sample yet: it counts as 0
    assert {"ctx0": 0, "gen0": 0, **_wait_in_flight_zero(urls["router"])} == {"ctx0": 0, "gen0": 0}
    _pools_full(urls)
