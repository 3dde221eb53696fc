"""KVCacheManager: allocation, pinning, deferred frees, misuse errors, exhaustion; free count restored."""

from __future__ import annotations

import pytest
import torch

from kvbridge.errors import KVCacheError, KVCacheExhausted
from kvbridge.kvcache.manager import KVCacheManager, SeqState
from kvbridge.formatter.layout import KVLayout, KVShape, ParallelSplit


def _mgr(num_blocks=8, tp=2, pp=2, rank=3):
    layout = KVLayout(KVShape(num_layers=5, num_kv_heads=4, head_dim=8, tokens_per_block=4),
                      ParallelSplit(tp, pp))
    return KVCacheManager(layout, rank, num_blocks)


def test_pool_is_one_contiguous_block_major_tensor_of_the_layout_shape():
    m = _mgr()
    assert m.pool.is_contiguous()
    assert tuple(m.pool.shape) == m.layout.pool_shape(3, 8) == (8, 2, 2, 2, 4, 8)
    assert m.pool.numel() * m.pool.element_size() == 8 * m.layout.block_bytes(3)


def test_get_buffers_is_a_trtllm_shaped_view_of_the_pool():
    m = _mgr()
    buf = m.get_buffers(1)
    assert tuple(buf.shape) == (8, 2, 4, 2, 8)  # [blocks, kv, tokens, heads, head_dim]
    buf[5, 1, 3, 0, :] = torch.arange(8, dtype=torch.float32)
    assert torch.equal(m.pool[5, 1, 1, 0, 3], torch.arange(8, dtype=torch.float32))
    with pytest.raises(KVCacheError, match="local layer 2"):
        m.get_buffers(2)


def test_allocation_grows_by_block_and_frees_back_to_the_start_count():
    m = _mgr()
    start = m.get_num_free_blocks()
    assert m.add_sequence(1, 5) == [0, 1]
    m.prepare_resources([(1, 8), (2, 1)])
    assert m.get_batch_cache_indices([1, 2]) == [[0, 1], [2]]
    m.prepare_resources([(1, 9)])
    assert m.get_batch_cache_indices([1]) == [[0, 1, 3]]
    m.update_resources([(1, 9)])
    assert m.num_tokens(1) == 9
    assert m.get_needed_resource_to_completion(16, 1) == 1
    assert m.get_needed_resource_to_completion(16) == 4
    bt = m.block_table([1, 2])
    assert bt.tolist() == [[0, 1, 3], [2, 0, 0]]
    m.free_resources(1)
    m.free_resources(2)
    assert m.get_num_free_blocks() == start == m.get_max_resource_count()


def test_pinned_request_keeps_its_blocks_until_the_last_unpin():
    m = _mgr()
    blocks = m.add_sequence(7, 12)
    assert m.pin(7) == blocks and m.pin(7) == blocks
    m.free_resources(7)
    assert 7 not in m
    assert m.get_num_free_blocks() == 8 - 3
    # pinned blocks are not reused by a new request
    other = m.add_sequence(8, 20)
    assert not set(other) & set(blocks)
    m.unpin(7)
    assert m.get_num_free_blocks() == 0
    m.unpin(7)
    assert m.get_num_free_blocks() == 3
    m.free_resources(8)
    assert m.get_num_free_blocks() == 8


def test_double_free_unknown_request_and_bad_unpin_raise_clear_errors():
    m = _mgr()
    with pytest.raises(KVCacheError, match="unknown request 42"):
        m.free_resources(42)
    with pytest.raises(KVCacheError, match="unknown"):
        m.pin(42)
    with pytest.raises(KVCacheError, match="not pinned"):
        m.unpin(42)
    m.add_sequence(1, 3)
    m.free_resources(1)
    with pytest.raises(KVCacheError, match="unknown request 1"):
        m.free_resources(1)
    m.add_sequence(2, 3)
    m.pin(2)
    m.free_resources(2)
    with pytest.raises(KVCacheError, match="double free of request 2"):
        m.free_resources(2)
    with pytest.raises(KVCacheError, match="already freed"):
        m.pin(2)
    with pytest.raises(KVCacheError, match="already has blocks"):
        m.add_sequence(2, 1)
    m.unpin(2)
    with pytest.raises(KVCacheError, match="not pinned"):
        m.unpin(2)
    assert m.get_num_free_blocks() == 8


def test_exhaustion_refuses_the_request_and_changes_nothing():
    m = _mgr()
    m.add_sequence(1, 20)  # 5 blocks
    before = (m.get_num_free_blocks(), m.get_batch_cache_indices([1]))
    with pytest.raises(KVCacheExhausted, match="4 more blocks needed.*only 3 of 8 free; request refused"):
        m.prepare_resources([(1, 24), (2, 12)])  # needs 1 + 3
    assert (m.get_num_free_blocks(), m.get_batch_cache_indices([1])) == before
    assert 2 not in m
    with pytest.raises(KVCacheExhausted):
        m.add_sequence(3, 13)
    assert 3 not in m
    m.add_sequence(3, 12)
    m.free_resources(1)
    m.free_resources(3)
    assert m.get_num_free_blocks() == 8


def test_per_request_limit_is_enforced():
    layout = KVLayout(KVShape(num_layers=2, num_kv_heads=2, head_dim=4, tokens_per_block=2))
    m = KVCacheManager(layout, 0, 16, max_blocks_per_seq=3)
    with pytest.raises(KVCacheExhausted, match="more than the 3"):
        m.add_sequence(1, 7)
    assert m.get_num_free_blocks() == 16


def test_generation_only_blocks_await_kv_then_become_ready():
    m = _mgr()
    blocks = m.add_sequence_for_transfer(5, 9)
    assert len(blocks) == 3 and m.state(5) == SeqState.AWAITING_KV and m.num_tokens(5) == 9
    m.mark_ready(5)
    assert m.state(5) == SeqState.ACTIVE
    with pytest.raises(KVCacheError, match="not awaiting KV"):
        m.mark_ready(5)
    m.prepare_resources([(5, 10)])
    m.free_resources(5)
    assert m.get_num_free_blocks() == 8


def test_padding_requests_are_freed_like_any_other():
    m = _mgr()
    m.add_padding_request(-1)
    assert m.state(-1) == SeqState.PADDING and m.get_num_free_blocks() == 7
    m.free_resources(-1)
    assert m.get_num_free_blocks() == 8


def test_random_sequences_of_operations_restore_the_free_count():
    import random

    rng = random.Random(0)
    m = _mgr(num_blocks=16)
    live, pinned = {}, {}
    for step in range(400):
        op = rng.random()
        if op < 0.4:
            rid = step
            try:
                m.add_sequence(rid, rng.randint(1, 20))
                live[rid] = True
            except KVCacheExhausted:
                assert rid not in m
        elif op < 0.55 and live:
            rid = rng.choice(list(live))
            try:
                m.prepare_resources([(rid, m.num_tokens(rid) + rng.randint(1, 8))])
            except KVCacheExhausted:
                pass
        elif op < 0.7 and live:
            rid = rng.choice(list(live))
            m.pin(rid)
            pinned[rid] = pinned.get(rid, 0) + 1
        elif op < 0.85 and pinned:
            rid = rng.choice(list(pinned))
            m.unpin(rid)
            pinned[rid] -= 1
            if not pinned[rid]:
                del pinned[rid]
        elif live:
            rid = rng.choice(list(live))
            m.free_resources(rid)
            del live[rid]
        held = sum(len(m._seqs[r].blocks) for r in m._seqs)
        assert held + m.get_num_free_blocks() == 16
    for rid in list(live):
        m.free_resources(rid)
    for rid, n in pinned.items():
        for _ in range(n):
            m.unpin(rid)
    assert m.get_num_free_blocks() == 16
