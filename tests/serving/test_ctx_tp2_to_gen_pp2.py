"""A context worker at TP2 and a generation worker at TP1/PP2 (different block sizes) behind the router, over
real HTTP, the transceiver moving KV between real processes (tcp agent). on_transfer_failure: recompute.
Every answer that crossed passes the positional KV check (kvcheck.py): the generation worker's KV, gathered
in token order, equals the context worker's remapped from TP2 / 4-token blocks to PP2 / 12-token blocks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import pytest

from kvbridge.errors import ExecutorError

from .cluster import HEADERS, MODEL, PATIENT, PROMPTS, config, free_blocks, launch, sse_events, \
    start_announced, stop_process, streamed_tokens, wait_healthy, wait_pool_full
from .conftest import CHAT, MAX_TOKENS
from .kvcheck import assert_kv_positional, handles_of
from .faults import rank_processes, stopped

CTX_BLOCKS, GEN_BLOCKS = 256, 96
CFG = {
    "model": MODEL, "on_transfer_failure": "recompute",
    "executor": {"num_blocks": CTX_BLOCKS, "tokens_per_block": 4, "threads_per_rank": 1, "timeout_s": 120,
                 "kv_digests": True},
    "transceiver": {"agent": "tcp", "handshake_timeout_s": 3, **PATIENT},
    "router": {"port": 0, "policy": "least_loaded", "request_timeout_s": 120},
    "context_servers": {"tp": 2},
    # whole pulls: the positional KV check is byte-exact only for KV that crossed (kvcheck.py)
    "generation_servers": {"pp": 2, "executor": {"num_blocks": GEN_BLOCKS, "tokens_per_block": 12,
                                                  "enable_block_reuse": False}},
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = launch(CFG, str(tmp_path_factory.mktemp("logs")))
    yield c
    c.stop()


@pytest.fixture(scope="module")
def urls(cluster):
    return {"router": cluster.router_url + "/v1", "ctx": cluster.cfg.context[0].url,
            "gen": cluster.cfg.generation[0].url}


def _complete(url: str, body: dict) -> dict:
    r = httpx.post(url + "/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_disaggregated_completions_give_exactly_the_aggregated_tokens(urls, want):
    handles = []
    for prompt, tokens in zip(PROMPTS, want["prompts"]):
        out = _complete(urls["router"], {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                         "temperature": 0})
        kb = out["kvbridge"]
        assert kb["token_ids"] == tokens
        assert kb["recomputed"] is False
        assert kb["context_worker"] == "ctx0" and kb["generation_worker"] == "gen0"
        assert kb["transfer"]["bytes"] > 0 and kb["transfer"]["fragments"] > 0
        assert kb["transfer"]["agents"] == ["tcp"]
        assert out["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": MAX_TOKENS,
                                "total_tokens": len(prompt) + MAX_TOKENS}
        assert out["choices"][0]["finish_reason"] == "length"
        handles += handles_of(kb)
    assert assert_kv_positional(urls["ctx"], urls["gen"], handles) == len(PROMPTS)


def test_streaming_sends_the_aggregated_tokens_in_pieces_then_done(urls, want):
    body = {"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    with httpx.stream("POST", urls["router"] + "/completions", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]" and len(events) > 2
    assert streamed_tokens(events) == want["prompts"][1]
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["kvbridge"]["transfer"]["bytes"] > 0
    handles = handles_of(events[-2]["kvbridge"])

    chat = {"messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", urls["router"] + "/chat/completions", json=chat, timeout=120) as r:
        events = sse_events(r)
    assert events[0]["object"] == "chat.completion.chunk"
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert streamed_tokens(events) == want["chat"]
    assert events[-2]["usage"]["completion_tokens"] == MAX_TOKENS and events[-1] == "[DONE]"
    handles += handles_of(next(e["kvbridge"] for e in events if isinstance(e, dict) and "handle" in
                               e.get("kvbridge", {})))
    assert assert_kv_positional(urls["ctx"], urls["gen"], handles) == 2


def test_32_concurrent_requests_are_all_answered_and_both_pools_end_full(urls, want):
    async def one(client, i):
        p = PROMPTS[i % len(PROMPTS)]
        body = {"prompt": p, "max_tokens": 6, "temperature": 0}
        r = await client.post(urls["router"] + "/completions", json=body)
        return i, r.status_code, r.json()

    async def all32():
        async with httpx.AsyncClient(timeout=180) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    handles = []
    for i, status, body in asyncio.run(all32()):
        assert status == 200, body
        assert body["kvbridge"]["token_ids"] == want["prompts"][i % len(PROMPTS)][:6]
        handles += handles_of(body["kvbridge"])
    assert assert_kv_positional(urls["ctx"], urls["gen"], handles) == 32
    assert wait_pool_full(urls["ctx"], CTX_BLOCKS, 2) == [CTX_BLOCKS] * 2  # released after confirmation
    assert wait_pool_full(urls["gen"], GEN_BLOCKS, 2) == [GEN_BLOCKS] * 2


def test_worker_metrics_merge_the_transceiver_metrics_of_every_rank_process(urls, want):
    # its own request first: the counters below must not depend on what earlier tests left (it passes alone)
    out = _complete(urls["router"], {"prompt": PROMPTS[2], "max_tokens": MAX_TOKENS, "temperature": 0})
    assert out["kvbridge"]["token_ids"] == want["prompts"][2] and out["kvbridge"]["recomputed"] is False
    ctx = httpx.get(urls["ctx"] + "/metrics", headers=HEADERS).text
    gen = httpx.get(urls["gen"] + "/metrics", headers=HEADERS).text
    # counted inside the rank processes (transceiver/metrics.py), summed over them by the worker's /metrics
    assert 'kvbridge_transfers_total{outcome="ok",role="generation"}' in gen
    assert 'kvbridge_transfers_total{outcome="complete",role="context"}' in ctx
    assert "kvbridge_transfer_bytes_total" in gen
    assert 'kvbridge_phase_seconds_bucket{le="0.5",phase="read"}' in gen
    # the worker's own request metrics
    assert 'kvbridge_serving_requests_total{kind="completion",outcome="ok",role="generation"}' in gen
    assert 'kvbridge_serving_request_seconds_count{phase="prefill",role="context"}' in ctx
    router = httpx.get(urls["router"].removesuffix("/v1") + "/metrics", headers=HEADERS).text
    assert 'kvbridge_router_requests_total{endpoint="completions",status="200"}' in router


def _client_closed(url: str) -> float:
    """The generation worker's count of requests ended because the client (the router) went away."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(url + "/metrics", headers=HEADERS).text.splitlines()
               if line.startswith("kvbridge_serving_requests_total{") and 'outcome="client_closed"' in line)


def test_a_client_that_goes_away_mid_stream_aborts_its_generation(urls):
    """The generation worker's rank processes are stopped (SIGSTOP) from the first chunk until the client has
    hung up, so the request cannot finish first however fast the box is."""
    before = _client_closed(urls["gen"])  # other tests (a router deadline) may have counted some already
    ranks = rank_processes(httpx.get(urls["gen"] + "/health", headers=HEADERS).json()["pid"])
    body = {"prompt": PROMPTS[0], "max_tokens": 1000, "temperature": 0, "stream": True}
    with contextlib.ExitStack() as paused:
        with httpx.stream("POST", urls["router"] + "/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    paused.enter_context(stopped(ranks))
                    break  # one chunk, then hang up (the ranks run again once the connection is closed)
    deadline = time.monotonic() + 60
    while _client_closed(urls["gen"]) == before:  # the generation worker saw the router hang up and aborted
        assert time.monotonic() < deadline, "the generation worker never counted the client going away"
        time.sleep(0.3)
    assert wait_pool_full(urls["gen"], GEN_BLOCKS, 2, timeout=30) == [GEN_BLOCKS] * 2


def test_a_transfer_that_fails_is_recomputed_by_the_generation_worker(urls, want, tmp_path):
    """Fault: a context worker advertising its transceiver on 127.0.0.2, where nothing listens."""
    bad = {**CFG, "transceiver": {**CFG["transceiver"], "advertise_host": "127.0.0.2", "pickup_timeout_s": 3},
           "context_servers": {"tp": 1, "urls": ["127.0.0.1:0"],
                               "executor": {"num_blocks": 32, "tokens_per_block": 4, "kv_digests": False}},
           "generation_servers": {"pp": 2, "urls": [urls["gen"].removeprefix("http://")]},
           "router": {"port": 0}}
    with _one_worker_behind_a_router(tmp_path, "bad", bad, "context") as (bad_ctx, base):
        out = _complete(base + "/v1", {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0})
        kb = out["kvbridge"]
        assert kb["recomputed"] is True and "127.0.0.2" in kb["transfer_error"], kb
        assert kb["token_ids"] == want["prompts"][0]
        _no_digest_of_a_recomputed_request(bad_ctx, urls["gen"], kb["handle"])
        assert wait_pool_full(bad_ctx, 32, 1, timeout=30) == [32]  # never picked up: pickup timeout frees it
        assert wait_pool_full(urls["gen"], GEN_BLOCKS, 2) == [GEN_BLOCKS] * 2
        metrics = httpx.get(urls["gen"] + "/metrics", headers=HEADERS).text
        assert "kvbridge_serving_recomputes_total 1.0" in metrics


@contextlib.contextmanager
def _one_worker_behind_a_router(tmp_path, name: str, cfg: dict, role: str, module: str | None = None):
    """One worker of `role` started from `cfg` (its group's urls: ["127.0.0.1:0"]; `module` runs a test's own
    worker) and a router sending that group to it: yields (worker URL, router base URL), both stopped after."""
    group = "context_servers" if role == "context" else "generation_servers"
    args = ["--config", config(tmp_path, name, cfg), "--role", role]
    if module is None:
        worker, url = start_announced(["worker", *args], str(tmp_path / f"{name}.log"))
    else:
        worker, url = start_announced(args, str(tmp_path / f"{name}.log"), module=module)
    router = None
    try:
        wait_healthy(url, worker)
        routed = {**cfg, group: {**cfg[group], "urls": [url.removeprefix("http://")]}}
        router, base = start_announced(["router", "--config", config(tmp_path, f"{name}-router", routed)],
                                       str(tmp_path / f"{name}-router.log"))
        wait_healthy(base, router)
        yield url, base
    finally:
        if router is not None:
            stop_process(router)
        stop_process(worker)


def _no_digest_of_a_recomputed_request(ctx: str, gen: str, handle: int) -> None:
    """A context worker without kv_digests answers 409; the generation worker has the handle but no digest
    (its KV never arrived: the prompt was recomputed, aggregated), and says so."""
    r = httpx.get(ctx + "/internal/kv_digests", params={"handle": handle}, headers=HEADERS, timeout=30)
    assert r.status_code == 409 and r.json()["error"]["code"] == "kv_digests_off", r.text
    assert "executor.kv_digests: true" in r.json()["error"]["message"]
    r = httpx.get(gen + "/internal/kv_digests", params={"handle": handle}, headers=HEADERS, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "kv_digest_missing", r.text
    assert f"no KV digest of handle {handle}" in r.json()["error"]["message"]


def _ended_early(url: str) -> float:
    """The generation worker's count of requests it ended as the client went away or the deadline passed."""
    text = httpx.get(url + "/metrics", headers=HEADERS).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvbridge_serving_requests_total{")
               and ('outcome="client_closed"' in line or 'outcome="timeout"' in line))


def test_a_router_deadline_that_passes_aborts_the_generation(cluster, urls, tmp_path):
    """A router deadline that passes while the generation worker's rank processes are stopped (SIGSTOP: no
    token can come, however fast the box): 504 at the deadline; once they run again, the generation worker
    ends the request as its client went away and every block comes back."""
    deadline_s = 4
    cfg = {**CFG, "router": {"port": 0, "request_timeout_s": deadline_s},
           "context_servers": {"tp": 2, "urls": [urls["ctx"].removeprefix("http://")]},
           "generation_servers": {"pp": 2, "urls": [urls["gen"].removeprefix("http://")]}}
    router, base = start_announced(["router", "--config", config(tmp_path, "short", cfg)],
                                   str(tmp_path / "router.log"))
    try:
        wait_healthy(base, router)
        ranks = rank_processes(httpx.get(urls["gen"] + "/health", headers=HEADERS).json()["pid"])
        assert len(ranks) == 2, ranks  # PP2
        before = _ended_early(urls["gen"])
        with stopped(ranks):
            t0 = time.monotonic()
            r = httpx.post(base + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS},
                           timeout=60)
            took = time.monotonic() - t0
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout", r.text
        assert deadline_s <= took < deadline_s + 5, f"504 after {took:.1f} s"
        deadline = time.monotonic() + 60
        while _ended_early(urls["gen"]) == before:
            assert time.monotonic() < deadline, "the generation worker never ended the request"
            time.sleep(0.2)
        assert wait_pool_full(urls["gen"], GEN_BLOCKS, 2, timeout=30) == [GEN_BLOCKS] * 2
        assert wait_pool_full(urls["ctx"], CTX_BLOCKS, 2, timeout=30) == [CTX_BLOCKS] * 2
    finally:
        stop_process(router)


def test_bad_requests_get_openai_error_objects_through_the_router(urls):
    # earlier tests' context blocks are released asynchronously (after the readers confirm): wait for them
    assert wait_pool_full(urls["ctx"], CTX_BLOCKS, 2) == [CTX_BLOCKS] * 2
    r = httpx.post(urls["router"] + "/completions", json={"prompt": [], "max_tokens": 4}, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "prompt" and "prompt" in err["message"]
    r = httpx.post(urls["router"] + "/completions", json={"model": "gpt-9", "prompt": "hi"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(urls["router"] + "/completions", json={"prompt": [1, 999], "max_tokens": 2}, timeout=30)
    assert r.status_code == 400 and "999" in r.json()["error"]["message"]
    models = httpx.get(urls["router"] + "/models").json()
    assert models["data"][0]["id"] == MODEL
    assert json.loads(httpx.get(urls["router"].removesuffix("/v1") + "/health").text)["status"] == "ok"
    assert free_blocks(urls["ctx"]) == [CTX_BLOCKS] * 2  # a refused request pinned nothing


def test_blocks_swapped_on_the_generation_worker_keep_the_tokens_but_fail_the_positional_check(
        cluster, urls, want, tmp_path):
    """Fault: a generation worker whose ranks swap a request's first two blocks once its KV arrived
    (swap_worker.py; the deployment's generation CurveZMQ keys). The answer is still right; the serving check
    names the first (layer, kv head) moved."""
    cfg = {**CFG, "context_servers": {"tp": 2, "urls": [urls["ctx"].removeprefix("http://")]},
           "generation_servers": {"pp": 2, "urls": ["127.0.0.1:0"],
                                  "transceiver": dict(cluster.cfg.generation[0].transceiver),
                                  "executor": {"num_blocks": 16, "tokens_per_block": 12}}}
    with _one_worker_behind_a_router(tmp_path, "swap", cfg, "generation", "tests.serving.swap_worker") as (
            gen_url, base):
        out = _complete(base + "/v1", {"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0})
        kb = out["kvbridge"]
        assert kb["token_ids"] == want["prompts"][1] and kb["recomputed"] is False, kb  # tokens cannot see it
        (h,) = handles_of(kb)
        first = f"positional KV check of handle {h} failed: layer 0 kv head 0 K"
        with pytest.raises(ExecutorError, match=first) as e:
            assert_kv_positional(urls["ctx"], gen_url, [h])
        assert str(e.value).endswith(f"... and {4 * 6 * 2 - 8} more")  # tokens 0..23 moved: all K, V differ
        assert wait_pool_full(gen_url, 16, 2) == [16, 16]
