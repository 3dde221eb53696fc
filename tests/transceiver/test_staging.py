"""The staged path through real processes: the context rank packs a piece into its arena, the generation rank
reads it as one descriptor and unpacks it. Whole generation pools compared; arenas and pins back to zero."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.formatter.layout import KVLayout, KVShape, ParallelSplit

from .ranks import Cluster

STAGED = {"agents": ["nixl"], "lease_s": 30.0, "heartbeat_s": 0.5, "peer_timeout_s": 30.0,
          "staging_arena_bytes": 4 << 20, "staging_min_fragments": 8}
CTX_BLOCKS, GEN_BLOCKS = 40, 36


def L(tp, pp=1, heads=4, tpb=16, mla=False, layers=4):
    return KVLayout(KVShape(layers, 1 if mla else heads, 16, "bfloat16", tpb, mla), ParallelSplit(tp, pp))


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(5)
    yield c
    c.close()


def _run(c, ctx, gen, lengths, config, expect_staged=True):
    c.setup(ctx, gen, CTX_BLOCKS, GEN_BLOCKS, config)
    rng = np.random.default_rng(1)
    cfree, gfree = list(rng.permutation(CTX_BLOCKS)), list(rng.permutation(GEN_BLOCKS))
    reqs, pulls = [], []
    for i, n in enumerate(lengths):
        rid = 100 + i
        cb = [int(cfree.pop()) for _ in range(-(-n // ctx.shape.tokens_per_block))]
        gb = [int(gfree.pop()) for _ in range(-(-n // gen.shape.tokens_per_block))]
        reqs.append((rid, cb, n, rid))
        pulls.append([rid, c.params(rid), gb, n, rid])
    c.publish(reqs)
    answers = c.pull(pulls)
    for ans in answers:
        assert all(r["ok"] for r in ans["results"]), ans["results"]
        assert ans["mismatched_bytes"] == 0
        if expect_staged:  # long requests (many small fragments): one descriptor per context rank read from
            long = [r for r in ans["results"] if dict((p[0], p[3]) for p in pulls)[r["request_id"]] >= 150]
            assert long and all(r["fragments"] <= ctx.world_size for r in long), [(r["request_id"], r["fragments"]) for r in ans["results"]]
    assert all(s["pinned"] == 0 for s in c.wait_ctx_released())
    assert all(p.call("arena_in_use") == 0 for p in c.ctx + c.gen)
    return answers


@pytest.mark.parametrize("ctx, gen", [
    (L(4), L(1)),                      # one head per context rank: 1 KiB fragments -> staged
    (L(1), L(2, pp=2)),                # regrouped heads and layers
    (L(2, tpb=16), L(1, tpb=48)),      # block sizes differ
    (L(2, mla=True), L(1, pp=2, mla=True)),
], ids=["tp4_to_tp1", "tp1_to_tp2pp2", "blocks16_to_48", "mla_tp2_to_pp2"])
def test_staged_pulls_are_byte_exact_and_release_every_slot(cluster, ctx, gen):
    _run(cluster, ctx, gen, (1, 37, 150, 96), STAGED)


def test_a_full_arena_falls_back_to_direct_reads(cluster):
    tiny = {**STAGED, "staging_arena_bytes": 4096}  # too small for any piece: both sides go direct
    answers = _run(cluster, L(4), L(1), (150, 96), tiny, expect_staged=False)
    assert all(r["fragments"] > 4 for a in answers for r in a["results"])
