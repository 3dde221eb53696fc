"""The positional KV check itself (no processes): digests of one request's KV held by executors of different
splits and block sizes agree exactly; moved blocks, one changed element and bad digest frames do not pass."""

from __future__ import annotations

import json

import pytest
import torch

from kvbridge.errors import ExecutorError
from kvbridge.executor.config import ModelConfig, kv_layout_for
from kvbridge.executor.kv_check import RankDigest, from_json, merge, mismatches, shard_digests, to_json
from kvbridge.executor.kv_io import scatter_blocks, shard_of
from kvbridge.formatter.layout import ParallelSplit

CFG = ModelConfig(vocab_size=64, hidden_size=64, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=64,
                  head_dim=8)
TOKENS = 29


def _request_kv() -> torch.Tensor:
    """[layers, 2, kv_heads, tokens, head_dim], every element a distinct function of its position."""
    return torch.arange(4 * 2 * 4 * TOKENS * 8, dtype=torch.float32).reshape(4, 2, 4, TOKENS, 8) * 0.5 + 1


def _digest(kv: torch.Tensor, tp: int, pp: int, tpb: int, swap: bool = False):
    lay = kv_layout_for(CFG, ParallelSplit(tp, pp), "float32", tpb)
    nblk = -(-TOKENS // tpb)
    blocks = [3 * i + 1 for i in range(nblk)][::-1]  # scattered and out of order: the table decides
    shards = {}
    for r in range(lay.world_size):
        pool = torch.zeros(lay.pool_shape(r, 3 * nblk + 2))
        scatter_blocks(pool, blocks, shard_of(lay, r, kv))
        if swap:
            pool[[blocks[0], blocks[1]]] = pool[[blocks[1], blocks[0]]].clone()
        d = shard_digests(lay, r, pool, blocks, TOKENS)
        shards[r] = RankDigest.from_wire(RankDigest(7, r, d).to_wire())  # through the wire form, as ranks send
    return merge(lay, shards)


def test_digests_agree_across_tp_pp_and_block_sizes():
    kv = _request_kv()
    ctx = _digest(kv, tp=2, pp=1, tpb=4)
    assert len(ctx.digests) == 16 and len(set(ctx.digests.values())) == 16  # position-dependent: all differ
    for tp, pp, tpb in [(1, 2, 12), (4, 1, 8), (2, 2, 16), (1, 1, 29)]:
        assert mismatches(ctx, _digest(kv, tp, pp, tpb)) == [], (tp, pp, tpb)


def test_swapped_blocks_or_one_changed_element_fail_the_check():
    kv = _request_kv()
    ctx = _digest(kv, tp=2, pp=1, tpb=4)
    assert len(mismatches(ctx, _digest(kv, 1, 2, 12, swap=True), limit=100)) == 4 * 4 * 2
    bumped = kv.clone()
    bumped[2, 1, 3, 17, 5] += 1.0
    assert mismatches(ctx, _digest(bumped, 1, 2, 12)) == [
        f"layer 2 kv head 3 V: context {ctx.digests[(2, 3)][1]}, generation "
        f"{_digest(bumped, 1, 2, 12).digests[(2, 3)][1]}"]
    assert mismatches(ctx, _digest(kv[:, :, :, :TOKENS], 1, 1, 8)) == []
    short = _digest(kv, 2, 1, 4)
    assert "context hashed 29 tokens of float32, generation 28" in mismatches(
        ctx, type(short)(28, short.dtype, short.digests))[0]


@pytest.mark.parametrize("path, value, text", [
    ((2, 0), 99, "KV digest: version 99"),                   # [rid, rank, [v, n, dtype, keys, values], missing]
    ((0,), True, "RankDigest.request_id is True, expected int"),
    ((2, 3), [[0, "x"]], "bad entry"),
    ((2, 4), [], "1 keys but 0 values"),
])
def test_a_bad_digest_frame_is_refused_with_the_field_named(path, value, text):
    lay = kv_layout_for(CFG, ParallelSplit(1, 1), "float32", 4)
    pool = torch.ones(lay.pool_shape(0, 2))
    msg = RankDigest(1, 0, shard_digests(lay, 0, pool, [0], 1)).to_wire()
    msg[2][3], msg[2][4] = msg[2][3][:1], msg[2][4][:1]
    inner = msg
    for i in path[:-1]:
        inner = inner[i]
    inner[path[-1]] = value
    with pytest.raises(ExecutorError, match=text):
        RankDigest.from_wire(msg)


def test_merge_names_a_missing_rank_and_a_rank_without_a_digest():
    lay = kv_layout_for(CFG, ParallelSplit(2, 1), "float32", 4)
    with pytest.raises(ExecutorError, match=r"needs every rank 0..1, got \[0\]"):
        merge(lay, {0: RankDigest(1, 0, None, "x")})
    with pytest.raises(ExecutorError, match="rank 1 recorded no KV digest"):
        merge(lay, {0: RankDigest(1, 0, None, "rank 1 recorded no KV digest of request 1"),
                    1: RankDigest(1, 1, None, "y")})


def test_the_json_form_round_trips_and_a_bad_one_is_refused_with_the_field_named():
    ctx = _digest(_request_kv(), tp=2, pp=1, tpb=4)
    back = from_json(json.loads(json.dumps(to_json(ctx))))
    assert back == ctx and back.num_tokens == 29 and back.dtype == "float32"
    assert mismatches(ctx, back) == []
    good = to_json(ctx)
    bad = [({**good, "extra": 1}, "expected an object with"), ({**good, "version": True}, "version True"),
           ({**good, "num_tokens": -1}, "num_tokens is -1"),
           ({**good, "num_tokens": False}, "num_tokens is False"),
           ({**good, "digests": {}}, "digests must be an object"),
           ({**good, "digests": {"0;1": ["0" * 16] * 2}}, "key '0;1'"),
           ({**good, "digests": {"0,1": ["0" * 15] * 2}}, r"digests\['0,1'\]"),
           ({**good, "digests": {"0,1": ["0" * 16] * 3}}, r"digests\['0,1'\]"), ([good], "got 'list'")]
    for obj, text in bad:
        with pytest.raises(ExecutorError, match=text):
            from_json(obj, "the test's digest")
