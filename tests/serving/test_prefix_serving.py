"""Prefix reuse through serving (real processes, tcp agent): the turns of a chat reuse their history on both
workers, so the generation worker pulls only the tokens after the prefix it holds (a partial pull), and the
pulled blocks land after the reused ones: the positional KV check (kvcheck.py) compares every prompt token,
reused and pulled, with the context worker's KV byte for byte. Context TP2 with 4-token blocks, generation
TP1 with 8-token blocks: the partial pull is remapped too. Tokens equal aggregated decoding.

Why every turn's prompt is a whole number of generation blocks: the KV of a token the generation worker
decoded itself differs from the context worker's prefill of the same token in the last bits (about 1e-6 on
CPU: decode and prefill multiply matrices of different shapes; an aggregated executor shows the same, and
the tokens do not change). A cached block holding such a token can never equal the context's byte for byte,
so the turns are laid out for the generation worker to cache only blocks of KV that crossed: each prompt ends
on a block boundary and the answer (ANSWER < GEN_TPB tokens) stays in a partial block, never cached.
"""

from __future__ import annotations

import httpx
import pytest

from .cluster import MODEL, PATIENT, launch, reference, wait_pool_full
from .kvcheck import assert_kv_positional, handles_of

CTX_BLOCKS, GEN_BLOCKS, GEN_TPB = 128, 64, 8
CFG = {
    "model": MODEL,
    "executor": {"num_blocks": CTX_BLOCKS, "tokens_per_block": 4, "threads_per_rank": 1, "timeout_s": 120,
                 "kv_digests": True, "enable_block_reuse": True},
    "transceiver": {"agent": "tcp", "handshake_timeout_s": 3, **PATIENT},
    "router": {"port": 0, "request_timeout_s": 120},
    "context_servers": {"tp": 2},
    "generation_servers": {"tp": 1, "executor": {"num_blocks": GEN_BLOCKS, "tokens_per_block": GEN_TPB}},
}
SYSTEM = [201, 7, 93, 150, 12, 12, 64, 230, 5, 77, 180, 33, 41, 9, 118, 240, 2, 66, 99, 140, 3]  # 21 tokens
ANSWER = 6  # < GEN_TPB: see the module docstring


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = launch(CFG, str(tmp_path_factory.mktemp("logs")))
    yield c
    c.stop()


def _chat(router: str, user_token: int, turns: int) -> tuple[list[list[int]], list[dict]]:
    """A conversation: each turn's prompt is the previous one + its answer + a user message that ends the
    prompt on a generation block boundary."""
    prompts, kbs, prompt = [], [], list(SYSTEM)
    for t in range(turns):
        prompt = prompt + [user_token + t] * (-len(prompt) % GEN_TPB or GEN_TPB)
        r = httpx.post(router + "/v1/completions", json={"prompt": prompt, "max_tokens": ANSWER,
                                                         "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        kb = r.json()["kvbridge"]
        assert kb["recomputed"] is False, kb
        prompts.append(prompt)
        kbs.append(kb)
        prompt = prompt + kb["token_ids"]
    return prompts, kbs


def test_partial_pulls_place_the_pulled_blocks_after_the_reused_ones(cluster):
    prompts, kbs = _chat(cluster.router_url, 20, 3)
    other, okbs = _chat(cluster.router_url, 30, 1)  # another conversation on the same system prompt
    prompts, kbs = prompts + other, kbs + okbs
    assert [kb["token_ids"] for kb in kbs] == reference(prompts, ANSWER)  # exactly aggregated decoding
    reused = [kb["reused_tokens"] for kb in kbs]  # from the generation worker's prefix cache
    assert reused == [0, len(prompts[0]), len(prompts[1]), 16], (reused, [len(p) for p in prompts])
    per_token = kbs[0]["transfer"]["bytes"] / len(prompts[0])  # the first turn pulled its whole prompt
    for p, kb, r in zip(prompts[1:], kbs[1:], reused[1:]):  # the others only the tokens after their prefix
        assert kb["transfer"]["bytes"] == per_token * (len(p) - r), (len(p), r, kb["transfer"])
    handles = [h for kb in kbs for h in handles_of(kb)]
    ctx, gen = cluster.cfg.context[0].url, cluster.cfg.generation[0].url
    assert assert_kv_positional(ctx, gen, handles) == 4  # every prompt token in place, reused or pulled
    assert wait_pool_full(ctx, CTX_BLOCKS, 2) == [CTX_BLOCKS] * 2
    assert wait_pool_full(gen, GEN_BLOCKS, 1) == [GEN_BLOCKS]
