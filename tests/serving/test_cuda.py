"""Two GPUs (examples/serve_2gpu.yaml with the seeded model): the context worker on GPU 1, the generation
worker on GPU 0, KV moved GPU to GPU by the transceiver's automatic agent choice (cuda_ipc on one host)."""

from __future__ import annotations

import os

import httpx
import pytest

from kvbridge.executor.runtime import Executor, ExecutorConfig
from kvbridge.serving.config import load_config

from .cluster import MODEL, PROMPTS, launch, wait_pool_full

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "serve_2gpu.yaml")


@pytest.mark.multigpu
def test_ctx_on_gpu1_gen_on_gpu0_answers_exactly_the_aggregated_tokens(tmp_path):
    raw = load_config(EXAMPLE).raw
    cfg = {**raw, "model": MODEL, "executor": {**raw["executor"], "num_blocks": 64},
           "router": {**raw["router"], "port": 0}}
    for group in ("context_servers", "generation_servers"):
        cfg[group] = {**raw[group], "urls": ["127.0.0.1:0"]}
    ref = ExecutorConfig(model=MODEL, device="cuda:0", num_blocks=64, tokens_per_block=16)
    with Executor.start(ref) as ex:
        want = ex.generate(PROMPTS, max_tokens=10)  # bfloat16 on GPU 0, like the generation worker
    c = launch(cfg, str(tmp_path))
    try:
        for prompt, tokens in zip(PROMPTS, want):
            r = httpx.post(c.router_url + "/v1/completions", timeout=120,
                           json={"prompt": prompt, "max_tokens": 10, "temperature": 0})
            assert r.status_code == 200, r.text
            kb = r.json()["kvbridge"]
            assert kb["token_ids"] == tokens and kb["recomputed"] is False
            assert kb["transfer"]["agents"] == ["cuda_ipc"] and kb["transfer"]["bytes"] > 0
        ctx = httpx.get(c.cfg.context[0].url + "/health", headers=c.headers).json()
        gen = httpx.get(c.cfg.generation[0].url + "/health", headers=c.headers).json()
        assert (ctx["device"], gen["device"]) == ("cuda:1", "cuda:0")
        assert wait_pool_full(c.cfg.context[0].url, 64, 1) == [64]
        assert wait_pool_full(c.cfg.generation[0].url, 64, 1) == [64]
    finally:
        c.stop()
