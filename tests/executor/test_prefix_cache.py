"""Block reuse in the KVCacheManager: cached prefixes, shared blocks, LRU eviction, content-checked hits."""

from __future__ import annotations

import random

import pytest

from kvbridge.errors import KVCacheError, KVCacheExhausted
from kvbridge.kvcache import prefix_tree
from kvbridge.kvcache.manager import KVCacheManager
from kvbridge.formatter.layout import KVLayout, KVShape, ParallelSplit

TPB = 4


def _mgr(num_blocks=8, tp=1, model_id="m"):
    layout = KVLayout(KVShape(num_layers=2, num_kv_heads=2, head_dim=4, tokens_per_block=TPB),
                      ParallelSplit(tp, 1))
    return KVCacheManager(layout, 0, num_blocks, enable_block_reuse=True, model_id=model_id)


def _prefill(m, rid, prompt, reuse=True):
    """What the executor does for a prompt: reuse the cached prefix, compute the rest, record the tokens."""
    n = m.match_prefix(prompt, len(prompt) - 1) if reuse else 0
    m.add_sequence_reusing(rid, prompt, n)
    m.prepare_resources([(rid, len(prompt))])
    m.update_resources([(rid, len(prompt))], tokens={rid: prompt[n:]})
    return n


def _full(m):
    assert m.get_num_free_blocks() == m.get_max_resource_count()


def test_a_finished_prompts_full_blocks_stay_cached_and_are_reused():
    m = _mgr()
    p = list(range(100, 110))  # 10 tokens: 2 full blocks + 2 tokens
    assert _prefill(m, 1, p) == 0
    first = m.get_batch_cache_indices([1])[0]
    m.free_resources(1)
    _full(m)  # cached blocks count as free
    assert m.get_num_cached_blocks() == 2
    q = p[:8] + [7, 7, 7]
    assert m.match_prefix(q) == 8
    assert _prefill(m, 2, q) == 8
    assert m.get_batch_cache_indices([2])[0][:2] == first[:2]
    assert m.num_tokens(2) == 11 and m.reused_tokens == 8
    m.free_resources(2)
    _full(m)


def test_a_hit_is_capped_so_the_last_prompt_token_is_computed():
    m = _mgr()
    p = list(range(8))  # exactly 2 blocks
    _prefill(m, 1, p)
    m.free_resources(1)
    assert m.match_prefix(p) == 8
    assert m.match_prefix(p, len(p) - 1) == 4
    _full(m)


def test_live_requests_share_blocks_and_a_held_block_is_never_evicted():
    m = _mgr(num_blocks=6)
    p = list(range(50, 59))  # 3 blocks
    _prefill(m, 1, p)
    shared = m.get_batch_cache_indices([1])[0][:2]
    assert _prefill(m, 2, p[:8] + [1, 2, 3, 4, 5]) == 8  # shares 2 blocks, owns 2 more
    m.free_resources(1)  # block 3 of request 1 is private: back to the free list; 2 shared still held
    assert m.get_num_free_blocks() == 6 - 4
    m.add_sequence(3, 8)  # takes every free block: nothing held may go
    assert m.get_batch_cache_indices([2])[0][:2] == shared
    with pytest.raises(KVCacheExhausted):
        m.add_sequence(4, 1)
    m.free_resources(3)
    m.free_resources(2)
    _full(m)


def test_eviction_under_pressure_takes_lru_cached_blocks_and_never_pinned_ones():
    m = _mgr(num_blocks=8)
    old = list(range(200, 209))
    _prefill(m, 1, old)
    m.free_resources(1)  # 2 cached
    pinned = list(range(300, 309))
    _prefill(m, 2, pinned)
    held = set(m.pin(2))
    m.free_resources(2)  # its free waits for the unpin: its 3 blocks are held
    assert m.get_num_free_blocks() == 8 - 3
    taken = m.add_sequence(3, 20)  # 5 blocks: the 3 free ones and both cached blocks of `old`
    assert m.match_prefix(old) == 0
    assert m.get_num_free_blocks() == 0 and not held & set(taken)
    m.unpin(2)  # now `pinned` is cached (2 full blocks) and its partial block free
    assert m.match_prefix(pinned) == 8
    m.free_resources(3)
    _full(m)


def test_lru_evicts_the_least_recently_used_prefix_first():
    m = _mgr(num_blocks=6)
    a, b = [1] * 5, [2] * 5
    _prefill(m, 1, a)
    m.free_resources(1)
    _prefill(m, 2, b)
    m.free_resources(2)
    _prefill(m, 3, a + [9])  # touches a's block again
    m.free_resources(3)
    m.add_sequence(4, 4 * 5)  # 5 of 6 blocks: one cached block survives, the most recently used
    assert m.match_prefix(a) == 4 and m.match_prefix(b) == 0
    m.free_resources(4)
    _full(m)


def test_a_key_collision_is_a_miss_never_wrong_kv(monkeypatch):
    monkeypatch.setattr(prefix_tree, "block_key", lambda parent, tokens: b"same-key-for-all")
    m = _mgr()
    _prefill(m, 1, [1, 2, 3, 4, 5])
    m.free_resources(1)
    assert m.match_prefix([9, 9, 9, 9, 5]) == 0  # same key, other tokens
    assert m.match_prefix([1, 2, 3, 4, 5]) == 4
    _full(m)


def test_keys_depend_on_layout_and_model_so_they_never_mix():
    a, b, c = _mgr(tp=1), _mgr(tp=2), _mgr(model_id="other")
    toks = list(range(8))
    keys = [prefix_tree.chain_keys(x.fingerprint, toks, TPB) for x in (a, b, c)]
    assert len({k[0] for k in keys}) == 3
    assert prefix_tree.chain_keys(a.fingerprint, toks, TPB, 1) == keys[0][:1]


def test_generation_blocks_are_cached_only_once_their_kv_arrived_and_can_start_from_cache():
    m = _mgr()
    p = list(range(10, 19))
    m.add_sequence_for_transfer(1, len(p), tokens=p)
    assert m.match_prefix(p) == 0  # awaiting KV: not reusable
    m.mark_ready(1)
    assert m.match_prefix(p) == 8
    m.add_sequence_reusing(2, p, 8)
    blocks = m.add_sequence_for_transfer(2, len(p), tokens=p, num_reused=8)
    assert blocks[:2] == m.get_batch_cache_indices([1])[0][:2] and len(blocks) == 3
    m.mark_ready(2)
    m.free_resources(1)
    m.free_resources(2)
    _full(m)


def test_reusing_a_prefix_the_cache_does_not_hold_is_refused_and_changes_nothing():
    m = _mgr()
    with pytest.raises(KVCacheError, match="allocators diverged"):
        m.add_sequence_reusing(1, list(range(9)), 8)
    with pytest.raises(KVCacheError, match="cannot reuse 3 tokens"):
        m.add_sequence_reusing(1, list(range(9)), 3)
    assert 1 not in m
    off = KVCacheManager(m.layout, 0, 4)
    assert off.match_prefix(list(range(9))) == 0 and not off.block_reuse
    _full(m)


def test_random_operations_with_reuse_return_the_pool_to_full():
    rng = random.Random(1)
    m = _mgr(num_blocks=12)
    prefixes = [[rng.randrange(50) for _ in range(8)] for _ in range(3)]
    live, pinned = set(), {}
    for step in range(300):
        op = rng.random()
        if op < 0.45:
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 9))]
            try:
                _prefill(m, step, prompt)
                live.add(step)
            except KVCacheExhausted:
                m.free_resources(step)
        elif op < 0.6 and live:
            rid = rng.choice(sorted(live))
            m.pin(rid)
            pinned[rid] = pinned.get(rid, 0) + 1
        elif op < 0.75 and pinned:
            rid = rng.choice(sorted(pinned))
            m.unpin(rid)
            pinned[rid] -= 1
            if not pinned[rid]:
                del pinned[rid]
        elif live:
            rid = rng.choice(sorted(live))
            m.free_resources(rid)
            live.discard(rid)
        assert 0 <= m.get_num_free_blocks() <= 12
    for rid in live:
        m.free_resources(rid)
    for rid, n in pinned.items():
        for _ in range(n):
            m.unpin(rid)
    _full(m)
    assert m.reused_tokens > 0


def test_a_failed_transfer_onto_a_cached_prefix_frees_only_its_own_blocks():
    m = _mgr()
    p = list(range(30, 39))
    _prefill(m, 1, p)
    m.free_resources(1)
    m.add_sequence_reusing(2, p, 8)
    m.add_sequence_for_transfer(2, len(p), tokens=p, num_reused=8)
    m.free_resources(2)  # aborted before its KV arrived: the new block is freed, the prefix stays cached
    assert m.match_prefix(p) == 8 and m.get_num_cached_blocks() == 2
    _full(m)
