"""`kvbridge bench plan`: how long the planner takes to turn one request's block ids into descriptors.

The shape is Llama-70B's KV cache (80 layers, 8 kv heads, head_dim 128, bfloat16, 16 tokens per block) and the
request is 8k tokens. For each case every generation rank plans what it reads from every context rank it
needs (`plan_pieces`, block-id validation included), `--repeat` times; the figure is the median per rank.
TensorRT-LLM's cache transceiver spends ~10 ms building its transfer plan for a request like this; the goal
here is <= 1 ms per generation rank.

    kvbridge bench plan [--tokens 8192] [--repeat 50] [--blocks scattered|contiguous] [--json PATH]

Columns: fragments = (contiguous run) x (token segment) units before merging adjacent blocks, coalesced = the
descriptors actually handed to the agent, plan_ms = median milliseconds per generation rank (the slowest
rank's median, after 3 warm-up plans), template_ms = building a peer pair's plan templates (once per pair,
then cached; the slowest rank),
naive_ms = the baseline measured in the same run: a planner with one Python step per (block, layer, K/V, head)
run, once on generation rank 0 (its output is checked to move exactly the same bytes as the vectorised plan).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from ..formatter.layout import KVLayout, KVShape, ParallelSplit
from ..formatter.mapping import mapping_for
from ..formatter.planner import Fragments, RankPool, clear_plan_cache, coalesce, plan_pieces, plan_stats
from .common import machine, table, write_json

SHAPE = dict(num_layers=80, num_kv_heads=8, head_dim=128, dtype="bfloat16")
CASES = [  # (case name, ctx (tp, pp), gen (tp, pp))
    ("ctx TP8 -> gen TP4", (8, 1), (4, 1)),
    ("ctx TP1 -> gen TP8", (1, 1), (8, 1)),
    ("ctx TP8 -> gen TP8 (identity)", (8, 1), (8, 1)),
]


def _blocks(rng: np.random.Generator, pool: int, need: int, pattern: str) -> np.ndarray:
    if pattern == "contiguous":
        start = int(rng.integers(0, pool - need))
        return np.arange(start, start + need, dtype=np.int64)
    return rng.permutation(pool)[:need].astype(np.int64)


def naive_plan(pieces, ctx_pools: dict, gen_pool: RankPool, cb, gb, tokens: int) -> dict[int, Fragments]:
    """The baseline: one Python step per (block, layer, K/V, head) run, as a straightforward planner does.

    Only for equal block sizes and block_major pools (what this benchmark uses).
    """
    ga = gen_pool.addressing
    g_layers, g_heads = gen_pool.held()
    out = {}
    for p in pieces:
        ctx = ctx_pools[p.ctx_rank]
        ca, tpb = ctx.addressing, ctx.tpb
        c_layers, c_heads = ctx.held()
        src, dst, length = [], [], []
        for i in range(-(-tokens // tpb)):
            ntok = min(tpb, tokens - i * tpb)
            for layer in p.layers:
                for kv in range(ctx.layout.shape.kv_factor):
                    for h in p.heads:
                        src.append(int(ca.layer_base[layer - c_layers.start]) + int(cb[i]) * ca.block_stride
                                   + kv * ca.kv_stride + (h - c_heads.start) * ca.head_stride)
                        dst.append(int(ga.layer_base[layer - g_layers.start]) + int(gb[i]) * ga.block_stride
                                   + kv * ga.kv_stride + (h - g_heads.start) * ga.head_stride)
                        length.append(ntok * ca.token_stride)
        out[p.ctx_rank] = Fragments(np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64),
                                    np.array(length, dtype=np.int64))
    return out


def _canonical(f: Fragments) -> Fragments:
    order = np.argsort(f.dst, kind="stable")
    return coalesce(Fragments(f.src[order], f.dst[order], f.length[order]))


def run_case(name: str, ctx_split, gen_split, tokens: int, repeat: int, pattern: str, tpb: int = 16) -> dict:
    shape = KVShape(**SHAPE, tokens_per_block=tpb)
    ctx = KVLayout(shape, ParallelSplit(*ctx_split))
    gen = KVLayout(shape, ParallelSplit(*gen_split))
    mapping = mapping_for(ctx, gen)
    nblocks = -(-tokens // tpb)
    pool = 4 * nblocks
    rng = np.random.default_rng(7)
    ctx_pools = {r: RankPool.of(ctx, r, [(1 + r) << 40], pool) for r in range(ctx.world_size)}
    per_rank_ms, template_ms, frags, coal = [], [], 0, 0
    for g in range(gen.world_size):
        gen_pool = RankPool.of(gen, g, [(64 + g) << 40], pool)
        pieces = mapping.pieces(g)
        clear_plan_cache()
        t0 = time.perf_counter()  # the per-peer-pair templates (built on a pair's first plan, then cached)
        frags = max(frags, sum(plan_stats(p, ctx_pools[p.ctx_rank], gen_pool, tokens) for p in pieces))
        template_ms.append((time.perf_counter() - t0) * 1e3)
        times = []
        for i in range(repeat + 3):
            cb, gb = _blocks(rng, pool, nblocks, pattern), _blocks(rng, pool, nblocks, pattern)
            t0 = time.perf_counter()
            out = plan_pieces(pieces, ctx_pools, gen_pool, cb, gb, tokens)
            if i >= 3:  # the first plans also pay the allocator's first touch of their output pages
                times.append((time.perf_counter() - t0) * 1e3)
        coal = max(coal, sum(len(f) for f in out.values()))
        per_rank_ms.append(float(np.median(times)))
        if g == 0:  # the per-fragment Python baseline, once, on the same block ids; and the same bytes move
            t0 = time.perf_counter()
            base = naive_plan(pieces, ctx_pools, gen_pool, cb, gb, tokens)
            naive_ms = (time.perf_counter() - t0) * 1e3
            for r, f in out.items():
                a, b = _canonical(f), _canonical(base[r])
                pairs = ((a.src, b.src), (a.dst, b.dst), (a.length, b.length))
                if not all(np.array_equal(x, y) for x, y in pairs):
                    raise RuntimeError(f"{name}: vectorised plan differs from the baseline (ctx rank {r})")
    return {"case": name, "blocks": pattern, "tokens": tokens, "gen_ranks": gen.world_size,
            "fragments": frags, "coalesced": coal, "plan_ms": round(max(per_rank_ms), 4),
            "plan_ms_mean_rank": round(float(np.mean(per_rank_ms)), 4),
            "template_ms": round(max(template_ms), 3),
            "naive_ms": round(naive_ms, 1)}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="kvbridge bench plan", description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--blocks", default="scattered,contiguous",
                    help="block-id patterns, comma-separated: scattered (random ids) and/or contiguous")
    ap.add_argument("--json", default=None, help="write the rows as JSON to this path")
    a = ap.parse_args(argv)
    rows = []
    for pattern in a.blocks.split(","):
        for name, c, g in CASES:
            rows.append(run_case(name, c, g, a.tokens, a.repeat, pattern))
    print(f"plan building, Llama-70B KV (80 layers, 8 kv heads, head_dim 128, bf16, block 16), "
          f"{a.tokens} tokens; {machine()}")
    print(table(rows, ["case", "blocks", "gen_ranks", "fragments", "coalesced", "plan_ms", "template_ms",
                       "naive_ms"]))
    write_json(a.json, rows)
    return 0
