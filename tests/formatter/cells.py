"""The split matrix: every ctx (TP, PP) x gen (TP, PP) x kv heads (or MLA) x tokens_per_block pair.

A cell is one context/generation layout pair. Its variant (pool order on each side, explicit uneven layer
splits, dtype, request length, block-id seed) is derived deterministically from its index, so a failure is
reproducible from the cell alone (`Cell.cli()` prints the `kvbridge verify-layout` line).

Valid cells with small executors (world size <= SMALL_WORLD on both sides) are all run; larger ones are
sampled: every kind of large cell is kept (each TP pair x kv heads, each PP pair x tokens_per_block pair, each
(ctx TP, ctx PP, gen TP, gen PP)), plus a seeded random fill. KVBRIDGE_FULL_MATRIX=1 runs every valid cell
(8832; about a minute on 2 cores).
"""

from __future__ import annotations

import itertools
import os
import random
from dataclasses import dataclass

from kvbridge.formatter.layout import KVLayout, KVShape, ParallelSplit

TPS = (1, 2, 3, 4, 6, 8)
PPS = (1, 2, 3, 4)
HEADS = (1, 2, 3, 6, 8, "mla")
TPBS = ((16, 16), (16, 48), (64, 16), (32, 32))
NUM_LAYERS = 7
HEAD_DIM = 4
DTYPES = ("float16", "bfloat16", "float32", "float8_e4m3fn")
# explicit uneven layer splits of NUM_LAYERS per PP size (the default split is as even as possible)
EXPLICIT = {1: [(7,)], 2: [(1, 6), (5, 2)], 3: [(1, 1, 5), (4, 2, 1)], 4: [(1, 3, 1, 2), (4, 1, 1, 1)]}
ORDERS = (("block_major", "block_major"), ("block_major", "layer_pools"), ("layer_pools", "block_major"),
          ("layer_pools", "layer_pools"))
SMALL_WORLD = 4
EXTRA_LARGE = 400  # random large cells on top of the covering set


def shards(tp: int, heads) -> bool:
    """Can TP `tp` shard this head count? (MLA: always; else tp divides the heads or the heads divide tp)."""
    return heads == "mla" or heads % tp == 0 or tp % heads == 0


@dataclass(frozen=True)
class Cell:
    index: int
    ctx_tp: int
    ctx_pp: int
    gen_tp: int
    gen_pp: int
    heads: object  # int or "mla"
    tpb: tuple[int, int]

    @property
    def valid(self) -> bool:
        return shards(self.ctx_tp, self.heads) and shards(self.gen_tp, self.heads)

    @property
    def small(self) -> bool:
        return self.ctx_tp * self.ctx_pp <= SMALL_WORLD and self.gen_tp * self.gen_pp <= SMALL_WORLD

    def variant(self) -> dict:
        """Order, explicit layer splits, dtype, tokens and seed: deterministic in the cell index."""
        r = random.Random(self.index * 7919 + 13)
        ctx_lps = r.choice(EXPLICIT[self.ctx_pp]) if r.random() < 0.35 else None
        gen_lps = r.choice(EXPLICIT[self.gen_pp]) if r.random() < 0.35 else None
        return {"order": ORDERS[self.index % 4] if r.random() < 0.5 else ORDERS[0],
                "ctx_layers": ctx_lps, "gen_layers": gen_lps, "dtype": DTYPES[self.index % len(DTYPES)],
                "tokens": r.randint(1, 2 * max(self.tpb) + 9), "seed": self.index}

    def layouts(self) -> tuple[KVLayout, KVLayout]:
        """Build both layouts (raises LayoutError for an invalid cell)."""
        v = self.variant()
        mla = self.heads == "mla"
        kvh = 1 if mla else self.heads

        def one(tp, pp, tpb, lps, order):
            shape = KVShape(NUM_LAYERS, kvh, HEAD_DIM, v["dtype"], tpb, mla)
            return KVLayout(shape, ParallelSplit(tp, pp, lps), order)

        return (one(self.ctx_tp, self.ctx_pp, self.tpb[0], v["ctx_layers"], v["order"][0]),
                one(self.gen_tp, self.gen_pp, self.tpb[1], v["gen_layers"], v["order"][1]))

    def cli(self) -> str:
        v = self.variant()
        mla = self.heads == "mla"
        line = (f"kvbridge verify-layout --ctx tp={self.ctx_tp},pp={self.ctx_pp} --gen tp={self.gen_tp},"
                f"pp={self.gen_pp} --layers {NUM_LAYERS} --kv-heads {1 if mla else self.heads}"
                f" --head-dim {HEAD_DIM} --ctx-block {self.tpb[0]} --gen-block {self.tpb[1]}"
                f" --dtype {v['dtype']}"
                f" --tokens {v['tokens']}"
                f" --seed {v['seed']} --ctx-order {v['order'][0]} --gen-order {v['order'][1]}")
        if mla:
            line += " --mla"
        for side in ("ctx", "gen"):
            if v[f"{side}_layers"]:
                line += f" --{side}-layers " + ",".join(map(str, v[f"{side}_layers"]))
        return line

    def kinds(self) -> list[tuple]:
        """The kinds of cell this one stands for (the sample keeps at least one cell of every kind)."""
        return [("tp", self.ctx_tp, self.gen_tp, self.heads), ("pp", self.ctx_pp, self.gen_pp, self.tpb),
                ("world", self.ctx_tp, self.ctx_pp, self.gen_tp, self.gen_pp),
                ("heads_tpb", self.heads, self.tpb)]


def all_cells() -> list[Cell]:
    prod = itertools.product(TPS, PPS, TPS, PPS, HEADS, TPBS)
    return [Cell(i, *c) for i, c in enumerate(prod)]


def sample(cells: list[Cell]) -> list[Cell]:
    """All small valid cells, and a covering + random sample of the large valid ones (deterministic)."""
    valid = [c for c in cells if c.valid]
    if os.environ.get("KVBRIDGE_FULL_MATRIX") == "1":
        return valid
    picked = [c for c in valid if c.small]
    seen = {k for c in picked for k in c.kinds()}
    large = [c for c in valid if not c.small]
    random.Random(2024).shuffle(large)
    rest = []
    for c in large:
        new = [k for k in c.kinds() if k not in seen]
        if new:
            picked.append(c)
            seen.update(new)
        else:
            rest.append(c)
    picked += rest[:EXTRA_LARGE]
    return sorted(picked, key=lambda c: c.index)
