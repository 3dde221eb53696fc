"""Any physical pool order (a permutation of "lbkhn") maps byte-exact to any other, for engines' own caches.

vLLM's CPU backend keeps per layer [blocks, heads, K/V, tokens, head_dim] ("lbhkn"), its flash-attention
layout [K/V, blocks, tokens, heads, head_dim] ("lkbnh"); kvbridge's executor uses "block_major". Every cell
moves a whole request between two such pools through the planner (direct and staged) and compares every
byte of both pools, spare blocks included (formatter/verify.py).
"""

from __future__ import annotations

import pytest

from kvbridge.errors import LayoutError
from kvbridge.formatter.layout import KVLayout, KVShape, ParallelSplit, PoolAddressing, order_axes
from kvbridge.formatter.verify import verify_split

SPLITS = [((2, 1, 32), (1, 1, 64)), ((1, 1, 64), (2, 2, 32)), ((1, 2, 16), (4, 1, 16))]
ORDERS = [("lbhkn", "block_major"), ("block_major", "lbhkn"), ("lkbnh", "lbhkn"), ("blnhk", "layer_pools")]


def _layout(tp: int, pp: int, tpb: int, order: str) -> KVLayout:
    return KVLayout(KVShape(4, 4, 8, "float16", tpb), ParallelSplit(tp, pp), order)


@pytest.mark.parametrize("path", ["direct", "staged"])
@pytest.mark.parametrize("ctx_order,gen_order", ORDERS)
@pytest.mark.parametrize("ctx_split,gen_split", SPLITS)
def test_any_order_to_any_order_moves_every_byte_exact(ctx_order, gen_order, ctx_split, gen_split, path):
    r = verify_split(_layout(*ctx_split, ctx_order), _layout(*gen_split, gen_order), 150, path=path)
    assert r.ok, r
    assert all(m == 0 for m in r.mismatches.values())


def test_vllm_cpu_order_strides_are_its_tensor_strides():
    # vLLM CPU: per layer a [blocks, heads, tokens, 2 * head_dim] tensor, read as [blocks, heads, 2, tokens, D]
    lay = KVLayout(KVShape(4, 2, 32, "float32", 32), ParallelSplit(1, 1), "lbhkn")
    a = PoolAddressing.for_rank(lay, 0, [1 << 20], 10)
    e, D, T, H = 4, 32, 32, 2
    assert (a.block_stride, a.head_stride, a.kv_stride, a.token_stride) == (H * 2 * T * D * e, 2 * T * D * e,
                                                                            T * D * e, D * e)
    assert list(a.layer_base - (1 << 20)) == [i * 10 * H * 2 * T * D * e for i in range(4)]
    assert lay.pool_shape(0, 10) == (10, 2, 2, 32, 32)


@pytest.mark.parametrize("bad", ["lbkh", "lbkhh", "xbkhn", "", "BLOCK_MAJOR"])
def test_an_order_that_is_no_permutation_is_refused_by_name(bad):
    with pytest.raises(LayoutError, match="permutation of 'lbkhn'"):
        order_axes(bad)
    with pytest.raises(LayoutError, match=repr(bad)):
        _layout(1, 1, 16, bad)


def test_a_layouts_remembered_hash_stays_in_its_process():
    """KVLayout keeps its hash once computed (it is hashed per request); a pickled copy (spawned ranks get
    layouts that way) hashes anew, since a str's hash differs between processes."""
    import pickle

    a = _layout(2, 1, 16, "lbhkn")
    assert hash(a) == hash(a) == hash(_layout(2, 1, 16, "lbhkn")) and a == _layout(2, 1, 16, "lbhkn")
    b = pickle.loads(pickle.dumps(a))
    assert "_hash" not in vars(b) and b == a and hash(b) == hash(a) and {a: 1}[b] == 1
