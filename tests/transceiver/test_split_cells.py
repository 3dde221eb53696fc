"""Split cells through real processes: context ranks and generation ranks of different TP/PP/block sizes, real
ZeroMQ control plane, real NIXL (UCX) reads; every generation rank's WHOLE pool is compared after the pulls
(request tokens in place, every other byte untouched) and every context rank ends with nothing pinned.

One cluster of 6 rank processes is reused by every cell (re-initialised per layout) to save start-up time.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.formatter.layout import KVLayout, KVShape, ParallelSplit
from kvbridge.formatter.mapping import mapping_for

from .ranks import Cluster

CONFIG = {"agents": ["nixl"], "lease_s": 30.0, "heartbeat_s": 0.5, "peer_timeout_s": 30.0}  # loaded CI boxes
CTX_BLOCKS, GEN_BLOCKS = 48, 40
LENGTHS = (1, 37, 150, 96)  # one token, a partial block, many blocks, a whole number of blocks


def _layout(tp=1, pp=1, heads=4, tpb=16, mla=False, layers=6, lps=None) -> KVLayout:
    shape = KVShape(num_layers=layers, num_kv_heads=1 if mla else heads, head_dim=16, dtype="bfloat16",
                    tokens_per_block=tpb, mla=mla)
    return KVLayout(shape, ParallelSplit(tp, pp, lps))


CELLS = {
    "tp2_to_tp1": (_layout(tp=2), _layout(tp=1)),
    "tp1_to_tp2": (_layout(tp=1), _layout(tp=2)),
    "pp2_to_tp2": (_layout(pp=2, lps=(2, 4)), _layout(tp=2)),
    "tp3_to_tp2_six_heads": (_layout(tp=3, heads=6), _layout(tp=2, heads=6)),
    "block16_to_block48": (_layout(tp=2, tpb=16), _layout(tp=2, tpb=48)),
    "mla_tp2_to_tp4": (_layout(tp=2, mla=True), _layout(tp=4, mla=True)),
    "replicated_tp4_to_pp2_block64_to_16": (_layout(tp=4, heads=2, tpb=64), _layout(pp=2, heads=2, tpb=16)),
}


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(max(a.world_size + b.world_size for a, b in CELLS.values()))
    yield c
    c.close()


@pytest.mark.parametrize("name", list(CELLS))
def test_split_cell_moves_every_byte_between_real_processes(cluster, name):
    ctx, gen = CELLS[name]
    cluster.setup(ctx, gen, CTX_BLOCKS, GEN_BLOCKS, CONFIG)
    rng = np.random.default_rng(sum(map(ord, name)))
    ctx_free = list(rng.permutation(CTX_BLOCKS))
    gen_free = list(rng.permutation(GEN_BLOCKS))
    reqs, pulls = [], []
    for i, n in enumerate(LENGTHS):
        rid = 100 + i
        cb = [int(ctx_free.pop()) for _ in range(-(-n // ctx.shape.tokens_per_block))]
        gb = [int(gen_free.pop()) for _ in range(-(-n // gen.shape.tokens_per_block))]
        reqs.append((rid, cb, n, rid))
        pulls.append([rid, cluster.params(rid), gb, n, rid])
    cluster.publish(reqs)
    answers = cluster.pull(pulls, timeout=60)
    for g, ans in enumerate(answers):
        bad = [r for r in ans["results"] if not r["ok"]]
        assert not bad, f"{name}: generation rank {g}: {bad}"
        assert len(ans["results"]) == len(LENGTHS)
        assert ans["mismatched_bytes"] == 0, f"{name}: generation rank {g}: {ans['mismatched_bytes']} bytes differ"
        moved = sum(r["nbytes"] for r in ans["results"])
        want = sum(n * _rank_bytes_per_token(gen, g) for n in LENGTHS)
        assert moved == want, (name, g, moved, want)
    st = cluster.wait_ctx_released()
    assert all(s["pinned"] == 0 for s in st), f"{name}: context ranks still pin blocks: {st}"
    m = mapping_for(ctx, gen)
    for r, s in enumerate(st):
        done = {rid: status for rid, status, _ in s["finished"]}
        if m.readers_of(r):  # a context rank nobody reads from (a spare replica) releases its blocks too
            assert all(done.get(q[0]) == "complete" for q in reqs), (name, r, s["finished"])


def _rank_bytes_per_token(layout: KVLayout, rank: int) -> int:
    s = layout.shape
    return layout.local_layers(rank) * s.kv_factor * layout.local_kv_heads * s.head_dim * s.itemsize
