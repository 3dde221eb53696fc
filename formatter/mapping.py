"""Which context ranks hold what a generation rank needs: the ctx<->gen rank mapping for any TP/PP split.

Pure functions over layouts, cached per (context layout, generation layout) pair. The answer for one
generation rank is a tuple of `Piece`s: (context rank, global layer range, global kv-head range). Every
(layer, head) the generation rank holds is covered by exactly one piece — for heads duplicated across context
ranks (tp > kv_heads, or MLA) exactly one source is chosen, spread over the duplicates so that generation
ranks do not all read from the same context rank.

What overlaps is decided here; how to copy it (addresses, fragments) is the planner's job.

Strategies (small objects, named for logs and `verify-layout`):
    identity         same layout: generation rank r reads everything from context rank r
    same_heads       same TP size, so the same heads per TP rank; only PP (layer split) or block size differs
    regrouped_heads  head ranges differ (TP sizes differ, replication, MLA): pieces cut at head boundaries,
                     duplicated heads read from one replica each, spread round-robin over the readers

A generation rank never gets two pieces from one context rank (a context rank belongs to one stage and holds
one contiguous head range), so the transceiver can key its per-request legs by context rank.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..errors import LayoutError, LayoutMismatchError
from .layout import KVLayout

# Bumped whenever which context rank serves which piece changes (e.g. the replica choice): both sides must
# compute the same mapping, or a context rank waits for a reader that reads elsewhere. Checked at handshake.
MAPPING_VERSION = 2

__all__ = ["MAPPING_VERSION", "Piece", "RankMapping", "Strategy", "Identity", "SameHeads", "RegroupedHeads", "check_compatible",
           "mapping_for"]


@dataclass(frozen=True, slots=True)
class Piece:
    """A rectangle of KV a generation rank reads from one context rank (global layer and head ids)."""

    ctx_rank: int
    layers: range
    heads: range

    def __repr__(self) -> str:
        return (f"Piece(ctx_rank={self.ctx_rank}, layers={self.layers.start}..{self.layers.stop - 1}, "
                f"heads={self.heads.start}..{self.heads.stop - 1})")


_MUST_MATCH = ("num_layers", "num_kv_heads", "head_dim", "dtype", "mla")


def check_compatible(ctx: KVLayout, gen: KVLayout) -> None:
    """Raise LayoutMismatchError (naming the field, both values and both layouts) unless KV can move ctx->gen.

    tokens_per_block, TP, PP and pool order may differ; the model's KV shape may not.
    """
    for f in _MUST_MATCH:
        a, b = getattr(ctx.shape, f), getattr(gen.shape, f)
        if a != b:
            raise LayoutMismatchError(
                f"context and generation disagree on {f} (context {a}, generation {b});\n"
                f"    context layout:    {ctx.describe()}\n    generation layout: {gen.describe()}")


def _overlap(a: range, b: range) -> range:
    return range(max(a.start, b.start), min(a.stop, b.stop))


class Strategy:
    """How the pieces of one generation rank are found, for one (context, generation) layout pair.

    Small and stateless beyond the two layouts; `name` shows in logs and in `kvbridge verify-layout`.
    """

    name = "?"

    def __init__(self, ctx: KVLayout, gen: KVLayout) -> None:
        self.ctx, self.gen = ctx, gen

    def pieces(self, gen_rank: int) -> tuple[Piece, ...]:
        """Every (context rank, layers, heads) generation rank `gen_rank` reads; each (layer, head) once."""
        ctx, gen = self.ctx, self.gen
        g_tp, g_pp = gen.coords(gen_rank)
        need_layers, need_heads = gen.stage_layers(g_pp), gen.head_range(g_tp)
        out: list[Piece] = []
        for c_pp in range(ctx.split.pp):
            layers = _overlap(need_layers, ctx.stage_layers(c_pp))
            if layers:
                out += [Piece(ctx.rank_of(c_tp, c_pp), layers, heads)
                        for heads, c_tp in self.head_sources(need_heads, g_tp, g_pp)]
        return tuple(out)

    def head_sources(self, need: range, g_tp: int, g_pp: int) -> list[tuple[range, int]]:
        """(head run, context tp rank) covering `need`: one source per head, one run per context tp rank."""
        raise NotImplementedError


class Identity(Strategy):
    """Same layout on both sides: generation rank r reads everything from context rank r."""

    name = "identity"

    def pieces(self, gen_rank: int) -> tuple[Piece, ...]:
        g_tp, g_pp = self.gen.coords(gen_rank)
        return (Piece(gen_rank, self.gen.stage_layers(g_pp), self.gen.head_range(g_tp)),)


class SameHeads(Strategy):
    """Same TP size (so the same heads on every tp rank, replicas included): only the layer split differs.

    A generation rank reads from the context ranks of its own tp rank, one per overlapping stage.
    """

    name = "same_heads"

    def head_sources(self, need: range, g_tp: int, g_pp: int) -> list[tuple[range, int]]:
        return [(need, g_tp)]


class RegroupedHeads(Strategy):
    """TP sizes differ: head ranges are cut at context rank boundaries; duplicated heads get one source each.

    Where the context replicates a head (tp > kv heads, or MLA where every tp rank holds the latent cache),
    the generation ranks that need it are numbered (stage-major) and take the replicas round-robin, so reads
    spread evenly over the duplicates instead of all landing on the first.
    """

    name = "regrouped_heads"

    def head_sources(self, need: range, g_tp: int, g_pp: int) -> list[tuple[range, int]]:
        ctx, gen = self.ctx, self.gen
        tp, kvh = ctx.split.tp, ctx.shape.num_kv_heads
        if ctx.shape.mla:  # every context tp rank holds the latent; every generation rank needs it
            return [(need, (g_pp * gen.split.tp + g_tp) % tp)]
        if tp >= kvh:  # each head on `dup` context ranks
            dup, g_tp_n = tp // kvh, gen.split.tp
            holders = g_tp_n // kvh if g_tp_n >= kvh else 1  # generation tp ranks holding one head
            out = []
            for h in need:
                idx = g_pp * holders + (g_tp - h * holders if g_tp_n >= kvh else 0)
                out.append((range(h, h + 1), h * dup + idx % dup))
            return out
        per = kvh // tp
        out = []
        for c_tp in range(need.start // per, (need.stop - 1) // per + 1):
            heads = _overlap(need, range(c_tp * per, c_tp * per + per))
            if heads:
                out.append((heads, c_tp))
        return out


class RankMapping:
    """The mapping for one (context layout, generation layout) pair. Build with `mapping_for` (cached).

    Attributes:
        strategy: the strategy's name ("identity", "same_heads" or "regrouped_heads").
        rule: the Strategy object itself.
    """

    def __init__(self, ctx: KVLayout, gen: KVLayout) -> None:
        check_compatible(ctx, gen)
        self.ctx, self.gen = ctx, gen
        if ctx.to_wire() == gen.to_wire():
            self.rule: Strategy = Identity(ctx, gen)
        elif ctx.split.tp == gen.split.tp:
            self.rule = SameHeads(ctx, gen)
        else:
            self.rule = RegroupedHeads(ctx, gen)
        self.strategy = self.rule.name
        self._pieces = tuple(self.rule.pieces(r) for r in range(gen.world_size))
        readers: dict[int, list[int]] = {}
        for g, ps in enumerate(self._pieces):
            for c in sorted({p.ctx_rank for p in ps}):
                readers.setdefault(c, []).append(g)
        self._readers = {c: tuple(gs) for c, gs in readers.items()}

    def pieces(self, gen_rank: int) -> tuple[Piece, ...]:
        """What generation rank `gen_rank` reads, one Piece per (context rank, layer run, head run)."""
        if not 0 <= gen_rank < self.gen.world_size:
            raise LayoutError(f"generation rank {gen_rank} outside 0..{self.gen.world_size - 1}")
        return self._pieces[gen_rank]

    def ctx_ranks(self, gen_rank: int) -> tuple[int, ...]:
        """Context ranks `gen_rank` reads from, in ascending order."""
        return tuple(sorted({p.ctx_rank for p in self.pieces(gen_rank)}))

    def readers_of(self, ctx_rank: int) -> tuple[int, ...]:
        """Generation ranks that read from `ctx_rank` (the context side waits for all of them)."""
        if not 0 <= ctx_rank < self.ctx.world_size:
            raise LayoutError(f"context rank {ctx_rank} outside 0..{self.ctx.world_size - 1}")
        return self._readers.get(ctx_rank, ())

    def describe(self) -> str:
        lines = [f"strategy {self.strategy}: {self.ctx.describe()}  ->  {self.gen.describe()}"]
        for g in range(self.gen.world_size):
            lines.append(f"  gen rank {g}: " + ", ".join(map(repr, self.pieces(g))))
        return "\n".join(lines)


@functools.lru_cache(maxsize=256)
def _cached(ctx: KVLayout, gen: KVLayout) -> RankMapping:
    return RankMapping(ctx, gen)


def mapping_for(ctx: KVLayout, gen: KVLayout) -> RankMapping:
    """The (cached) RankMapping of a context/generation layout pair; LayoutMismatchError if incompatible."""
    return _cached(ctx, gen)
