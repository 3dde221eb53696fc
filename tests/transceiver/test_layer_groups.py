"""A large direct read goes out in growing layer groups (pull.layer_groups): the first copy starts after one
layer is planned. The groups cover the layers exactly once, in order; a small read stays one post; and a pull
big enough to be split is byte-exact between real rank processes (NIXL), whole pools compared."""

from __future__ import annotations

import pytest

from kvbridge.formatter.layout import KVLayout, KVShape
from kvbridge.transceiver.pull import layer_groups

from .ranks import Cluster, RankProc


@pytest.mark.parametrize("start, stop, blocks", [(0, 32, 512), (0, 80, 512), (8, 16, 600), (3, 7, 1024),
                                                 (0, 4, 1024)])
def test_a_large_read_goes_out_in_growing_groups_covering_every_layer_once(start, stop, blocks):
    groups = layer_groups(start, stop, blocks)
    assert groups[0] == (start, start + 1)  # the copy starts after one layer's plan
    assert [lo for lo, _ in groups[1:]] == [hi for _, hi in groups[:-1]] and groups[-1][1] == stop
    sizes = [hi - lo for lo, hi in groups]
    assert all(b >= a for a, b in zip(sizes, sizes[1:]))


@pytest.mark.parametrize("start, stop, blocks", [(0, 2, 1), (0, 3, 4096), (0, 32, 16), (5, 6, 10000)])
def test_a_small_read_is_one_post(start, stop, blocks):
    assert layer_groups(start, stop, blocks) == [(start, stop)]


def test_a_pull_split_into_layer_groups_is_byte_exact():
    layout = KVLayout(KVShape(num_layers=8, num_kv_heads=2, head_dim=16, dtype="float16", tokens_per_block=4))
    c = Cluster(0)
    c.procs = [RankProc(), RankProc()]
    try:
        c.setup(layout, layout, 600, 600, {"agents": ["nixl"], "transfer_timeout_s": 60})
        n = 512 * 4  # 512 blocks x 8 layers: groups of 1, 2 and 5 layers
        assert len(layer_groups(0, 8, 512)) > 1
        ctx_blocks, gen_blocks = list(range(599, 87, -1)), list(range(40, 552))
        c.publish([(1, ctx_blocks, n, 1)])
        (ans,) = c.pull([[1, c.params(1), gen_blocks, n, 1]])
        r = ans["results"][0]
        assert r["ok"], r
        assert ans["mismatched_bytes"] == 0
        assert c.wait_ctx_released()[0]["pinned"] == 0
    finally:
        c.close()
