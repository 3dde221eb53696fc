"""KVCacheManager with TensorRT-LLM's constructor and scheduled batches, over kvbridge's manager."""

from __future__ import annotations

import pytest
import torch

from kvbridge.errors import KVCacheError
from kvbridge.trtllm import (CacheType, KvCacheConfig, KVCacheManager, LlmRequest, LlmRequestState as S,
                             LlmRequestType, Mapping, ScheduledRequests)


def _manager(max_tokens=64, mapping=Mapping(), **kw) -> KVCacheManager:
    args = dict(num_layers=4, num_kv_heads=2, head_dim=8, tokens_per_block=4, max_seq_len=32, max_batch_size=2,
                mapping=mapping, dtype=torch.float32)
    return KVCacheManager(KvCacheConfig(max_tokens=max_tokens), CacheType.SELF, **{**args, **kw})


def test_the_seed_constructor_sizes_the_pool_and_shards_by_mapping():
    m = _manager(mapping=Mapping(world_size=4, rank=3, tp_size=2, pp_size=2))
    assert m.get_max_resource_count() == 16 and m.tokens_per_block == 4
    assert m.pool.shape == (16, 2, 2, 1, 4, 8)  # pp stage 1 of 2: 2 layers; tp 2: one kv head
    assert _manager(max_tokens=None).get_max_resource_count() == 2 * 8  # max_batch_size x max_seq_len blocks


def test_scheduled_batches_allocate_grow_and_free_by_request():
    m = _manager()
    a = LlmRequest(1, list(range(9)), max_new_tokens=4)
    g = LlmRequest(2, list(range(5)), 3, LlmRequestType.REQUEST_TYPE_GENERATION_ONLY)
    assert m.get_needed_resource_to_completion(a) == 4  # 13 tokens in blocks of 4
    m.prepare_resources(ScheduledRequests(context_requests=[a, g]))
    assert len(m.get_cache_indices(a)) == 3 and len(m.get_cache_indices(g)) == 2
    assert g.state is S.DISAGG_GENERATION_INIT and m.impl.state(2) == "awaiting_kv"
    a.add_new_token(7)
    a.state = S.GENERATION_IN_PROGRESS
    m.update_resources(ScheduledRequests(context_requests=[a]))
    assert m.impl.num_tokens(1) == 9
    for t in (8, 9, 10):
        m.prepare_resources(ScheduledRequests(generation_requests=[a]))
        a.add_new_token(t)
        m.update_resources(ScheduledRequests(generation_requests=[a]))
    assert len(m.get_cache_indices(a)) == 3 and m.impl.num_tokens(1) == 12
    m.prepare_resources(ScheduledRequests(generation_requests=[a]))  # the 13th token needs a 4th block
    assert m.get_needed_resource_to_completion(a) == 0
    m.free_resources(a)
    m.free_resources(g)
    assert m.get_num_free_blocks() == 16


def test_an_exhausted_pool_refuses_the_whole_batch_and_allocates_nothing():
    m = _manager(max_tokens=16)
    a, b = LlmRequest(1, list(range(12))), LlmRequest(2, list(range(8)))
    with pytest.raises(KVCacheError):
        m.prepare_resources(ScheduledRequests(context_requests=[a, b]))
    assert m.get_num_free_blocks() == 4 and 1 not in m.impl and 2 not in m.impl


@pytest.mark.parametrize("make, match", [
    (lambda: _manager(mapping=Mapping(world_size=3, tp_size=2)), "world_size 3 must equal"),
    (lambda: KVCacheManager(KvCacheConfig(), CacheType.CROSS, num_layers=1, num_kv_heads=1, head_dim=8,
                            tokens_per_block=4, max_seq_len=8, max_batch_size=1, mapping=Mapping()), "CROSS"),
    (lambda: KvCacheConfig.from_dict({"host_cache_size": 1}), "kv_cache_config.host_cache_size: unknown key"),
    (lambda: _manager(dtype="complex64"), "dtype: 'complex64'"),
])
def test_what_is_not_supported_is_refused_by_name(make, match):
    with pytest.raises(KVCacheError, match=match):
        make()
