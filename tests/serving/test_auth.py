"""HTTP authentication (issue 13): workers answer only the deployment's own processes (internal token), the
router's public API takes API keys (checked with the official openai client), and a worker without a token
refuses to listen beyond loopback. Real processes: the launcher's workers and router, real HTTP."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import openai
import pytest

from kvbridge.serving.auth import TOKEN_ENV, TOKEN_HEADER
from kvbridge.serving.config import parse_config
from kvbridge.serving.router import build_router

from .cluster import HEADERS, MODEL, PATIENT, PROMPTS, config, launch, wait_pool_full
from .conftest import MAX_TOKENS

BLOCKS = 64
KEY = "sk-kvbridge-test-right-key"
CFG = {
    "model": MODEL,
    "executor": {"num_blocks": BLOCKS, "tokens_per_block": 8, "threads_per_rank": 1, "timeout_s": 120},
    "transceiver": {"agent": "tcp", **PATIENT},
    "router": {"port": 0, "request_timeout_s": 120, "api_keys": [KEY]},
    "context_servers": {"tp": 1},
    "generation_servers": {"tp": 1},
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = launch(CFG, str(tmp_path_factory.mktemp("logs")))
    yield c
    c.stop()


def _served(url: str) -> float:
    text = httpx.get(url + "/metrics", headers=HEADERS, timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvbridge_serving_requests_total{"))


def _pinned(ctx_url: str) -> int:
    r = httpx.get(ctx_url + "/debug/free_blocks", headers=HEADERS, timeout=30)
    return r.json()["pinned_context_requests"]


def test_a_generation_worker_refuses_a_post_without_the_token_before_any_pull(cluster, want):
    ctx, gen = cluster.cfg.context[0].url, cluster.cfg.generation[0].url
    body = {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0}
    r = httpx.post(ctx + "/v1/completions", headers=HEADERS, timeout=120,
                   json={**body, "disaggregated_params": {"request_type": "context_only"}})
    assert r.status_code == 200, r.text
    handover = {**body, "disaggregated_params": r.json()["disaggregated_params"]}  # a real, pullable request
    before = _served(gen)
    for headers in ({}, {TOKEN_HEADER: "not-the-token"}, {TOKEN_HEADER: ""}):
        r = httpx.post(gen + "/v1/completions", json=handover, headers=headers, timeout=30)
        assert r.status_code == 401, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_internal_token" and TOKEN_HEADER in err["message"]
    # nothing was pulled: the context request is still pinned and the generation worker served nothing
    assert _pinned(ctx) == 1 and _served(gen) == before
    r = httpx.post(gen + "/v1/completions", json=handover, headers=HEADERS, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["kvbridge"]["token_ids"] == want["prompts"][0]
    assert wait_pool_full(ctx, BLOCKS, 1) == [BLOCKS] and _pinned(ctx) == 0
    assert wait_pool_full(gen, BLOCKS, 1) == [BLOCKS]


def test_health_without_the_token_reveals_nothing_and_every_other_route_is_401(cluster):
    for s in cluster.cfg.servers():
        r = httpx.get(s.url + "/health", timeout=30)
        assert r.status_code == 200 and r.json() == {"status": "ok"}, r.text
        full = httpx.get(s.url + "/health", headers=HEADERS, timeout=30).json()
        assert full["name"] == s.name and full["instance"].startswith(s.name) and "pid" in full
        for path in ("/metrics", "/debug/free_blocks", "/v1/models", "/openapi.json"):
            assert httpx.get(s.url + path, timeout=30).status_code == 401, path
            assert httpx.get(s.url + path, headers={TOKEN_HEADER: "x" * 43}, timeout=30).status_code == 401
        r = httpx.post(s.url + "/v1/chat/completions", content=b"{not json", timeout=30)
        assert r.status_code == 401  # refused before the body is read


def test_the_router_takes_the_right_api_key_and_refuses_a_wrong_one(cluster, want):
    base = cluster.router_url + "/v1"
    with openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=120) as client:
        out = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0)
        assert out.model_extra["kvbridge"]["token_ids"] == want["prompts"][1]
        assert out.usage.completion_tokens == MAX_TOKENS
    with openai.OpenAI(base_url=base, api_key="sk-wrong", max_retries=0, timeout=60) as client:
        with pytest.raises(openai.AuthenticationError) as e:
            client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_TOKENS)
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    r = httpx.post(base + "/completions", json={"prompt": PROMPTS[1], "max_tokens": 2}, timeout=30)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    r = httpx.get(cluster.router_url + "/health", timeout=30)  # probes need no key, and learn up or down only
    assert r.status_code == 200 and r.json() == {"status": "ok"}, r.text
    full = httpx.get(cluster.router_url + "/health", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert full.json()["context_workers"] == {"ctx0": True}, full.text
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
        r = httpx.get(cluster.router_url + "/metrics", headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    r = httpx.get(cluster.router_url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200 and "kvbridge_router_" in r.text


def test_a_router_without_api_keys_refuses_to_listen_beyond_loopback(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "KVBRIDGE_API_KEY"}
    router = {"port": 0, "bind_host": "0.0.0.0"}
    path = config(tmp_path, "open", {**CFG, "router": router})
    r = subprocess.run([sys.executable, "-m", "kvbridge.cli", "router", "--config", path, "--port-file",
                        str(tmp_path / "port")], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2, r.stderr
    assert "would listen on 0.0.0.0 with no API keys" in r.stderr and "insecure: true" in r.stderr, r.stderr
    assert not (tmp_path / "port").exists()
    check = [sys.executable, "-m", "kvbridge.cli", "serve", "--check", path]
    r = subprocess.run(check, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and "with no API keys" in r.stderr, r.stderr
    assert subprocess.run([*check, "--api-key", KEY], capture_output=True, timeout=120, env=env).returncode == 0
    for opened in ({"insecure": True}, {"api_keys": [KEY]}):  # said so, or keys: it builds
        build_router(parse_config({**CFG, "router": {**router, **opened}}))


def test_a_worker_without_a_token_refuses_to_listen_beyond_loopback(tmp_path):
    cfg = {**CFG, "context_servers": {"urls": ["127.0.0.1:0"], "bind_host": "0.0.0.0"}}
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    path = config(tmp_path, "open", cfg)
    r = subprocess.run([sys.executable, "-m", "kvbridge.cli", "worker", "--config", path, "--role", "context",
                        "--port-file", str(tmp_path / "port")], capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode == 2, r.stderr
    assert "would listen on 0.0.0.0 without an internal token" in r.stderr and "insecure: true" in r.stderr
    assert not (tmp_path / "port").exists()
