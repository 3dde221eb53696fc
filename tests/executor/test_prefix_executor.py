"""Block reuse on real rank processes: a cached prompt prefix is not computed again, the tokens do not change,
context-only requests publish every block (cached prefix + new), and the pool returns to full."""

from __future__ import annotations

import pytest
import torch

from kvbridge.executor.runtime import Executor, ExecutorConfig

SYSTEM = [5, 17, 250, 3, 3, 91, 60, 8, 14, 200, 33, 1]  # 3 blocks of 4
CHAT_SYSTEM = [9, 44, 120, 7, 7, 61, 30, 18, 24, 100, 63, 2]  # the chat test's own: no other test caches it
TPB = 4


def _cfg(**kw):
    base = dict(model="seeded:tiny", num_blocks=24, tokens_per_block=TPB, timeout_s=60)
    base.update(kw)
    return ExecutorConfig(**base)


@pytest.fixture(scope="module")
def plain():
    with Executor.start(_cfg()) as ex:
        yield ex


@pytest.fixture(scope="module")
def reuse():
    with Executor.start(_cfg(tp=2, enable_block_reuse=True)) as ex:
        yield ex


def _chat(ex, turns):
    """Each turn's prompt is the previous prompt + its answer + a new user message."""
    prompt, outs, reused = list(CHAT_SYSTEM), [], []
    for t in range(turns):
        rid = ex.submit(prompt + [40 + t, 41 + t], max_tokens=5)
        c = ex.wait(rid)
        outs.append(c.tokens)
        reused.append(c.reused_tokens)
        prompt = prompt + [40 + t, 41 + t] + c.tokens
    return outs, reused


def test_multi_turn_chat_reuses_its_history_and_gives_the_same_tokens(plain, reuse):
    want, none = _chat(plain, 3)
    got, reused = _chat(reuse, 3)
    assert got == want
    assert none == [0, 0, 0]
    assert reused[0] == 0 and reused[1] >= 12 and reused[2] > reused[1]
    assert all(r % TPB == 0 for r in reused)
    assert reuse.free_blocks() == [24, 24] and plain.free_blocks() == [24]


def test_context_only_request_on_a_cached_prefix_publishes_all_its_blocks(plain, reuse):
    prompt = SYSTEM + [7, 8, 9]
    want = plain.prefill(prompt)
    want_kv = plain.read_kv(want.request_id)
    plain.release(want.request_id)
    first = reuse.prefill(prompt)
    reuse.release(first.request_id)
    again = reuse.prefill(prompt)
    assert again.reused_tokens == 12 and again.first_token == want.first_token == first.first_token
    assert len(again.block_ids) == 4 and again.block_ids[:3] == first.block_ids[:3]
    kv = reuse.read_kv(again.request_id)
    assert kv.shape == want_kv.shape
    torch.testing.assert_close(kv, want_kv, rtol=1e-4, atol=1e-5)
    reuse.release(again.request_id)
    assert reuse.free_blocks() == [24, 24]


def test_a_prompt_that_is_only_cached_blocks_still_computes_its_last_block(plain, reuse):
    prompt = SYSTEM[:8]  # two full blocks, both cached after the first request
    want = plain.generate([prompt], max_tokens=4)[0]
    assert reuse.generate([prompt], max_tokens=4)[0] == want
    rid = reuse.submit(prompt, max_tokens=4)
    c = reuse.wait(rid)
    assert c.tokens == want and c.reused_tokens == 4
    assert reuse.free_blocks() == [24, 24]


def test_eviction_under_pressure_keeps_every_answer_exact(plain, reuse):
    prompts = [[(7 * i + j) % 250 + 1 for j in range(13)] for i in range(10)]  # 3 full blocks each
    want = [plain.generate([p], max_tokens=4)[0] for p in prompts]
    got = [reuse.generate([p], max_tokens=4)[0] for p in prompts]  # 10 x 4 blocks > 24: old ones evicted
    again = [reuse.wait(reuse.submit(p, max_tokens=4)) for p in prompts[::-1]]
    assert got == want and [c.tokens for c in again] == want[::-1]
    assert any(c.reused_tokens for c in again) and not all(c.reused_tokens for c in again)
    assert reuse.free_blocks() == [24, 24]
