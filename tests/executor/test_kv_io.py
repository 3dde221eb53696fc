"""kv_io: a request's KV out of and into block_major pools, sharded and reassembled for any TP/PP split."""

from __future__ import annotations

import pytest
import torch

from kvbridge.errors import ExecutorError
from kvbridge.executor.kv_io import assemble, gather_blocks, scatter_blocks, shard_of
from kvbridge.formatter.layout import KVLayout, KVShape, ParallelSplit


def _positional(shape):
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)


def test_scatter_then_gather_round_trips_and_touches_only_the_named_blocks():
    pool = -torch.ones((10, 3, 2, 2, 4, 8))
    shard = _positional((3, 2, 2, 10, 8))
    scatter_blocks(pool, [7, 2, 5], shard)
    assert torch.equal(gather_blocks(pool, [7, 2, 5], 10), shard)
    untouched = [b for b in range(10) if b not in (7, 2, 5)]
    assert (pool[untouched] == -1).all()
    assert torch.equal(pool[2, 1, 0, 1, 3], shard[1, 0, 1, 7])  # block 2 holds tokens 4..7
    with pytest.raises(ExecutorError, match="does not fit"):
        scatter_blocks(pool, [1], shard)


@pytest.mark.parametrize("tp,pp,lps", [(1, 1, None), (2, 2, None), (4, 1, None), (8, 3, (1, 3, 1))])
def test_shards_reassemble_to_the_whole_kv(tp, pp, lps):
    layout = KVLayout(KVShape(num_layers=5, num_kv_heads=4, head_dim=8, tokens_per_block=4),
                      ParallelSplit(tp, pp, lps))
    kv = _positional((5, 2, 4, 9, 8))
    shards = {r: shard_of(layout, r, kv) for r in range(layout.world_size)}
    assert torch.equal(assemble(layout, shards), kv)
    if tp > 4:  # replicated heads: a differing replica is caught
        shards[1] = shards[1] + 1
        with pytest.raises(ExecutorError, match="replica of kv heads"):
            assemble(layout, shards)
