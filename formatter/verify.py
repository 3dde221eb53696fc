"""In-process, byte-exact check of a context/generation split: "will this P/D split work?".

Builds every rank's pool of both executors in one host arena, fills the context pools so that each element
encodes (layer, kv, head, token, dim), runs the real mapping and planner for every generation rank, executes
the fragments with a plain (vectorised) memcpy, and compares every byte of every generation pool against
what it must hold — request tokens in place, everything else untouched. Used by `kvbridge verify-layout`
and by the split-matrix tests. This is a checking tool, not a data path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .layout import KVLayout, order_axes
from .mapping import mapping_for
from .planner import Fragments, RankPool, plan_pieces
from .staging import plan_pack, plan_unpack, staged_read, staging_nbytes, staging_pool

__all__ = ["element_codes", "pool_image", "pool_nbytes", "Arena", "VerifyResult", "verify_split"]

_MIX = np.uint64(0x9E3779B97F4A7C15)


def element_codes(layer, kv, head, token, dim, itemsize: int, salt: int = 0) -> np.ndarray:
    """Bytes (uint8, last axis = itemsize) encoding each element's identity; broadcasts its arguments."""
    x = ((((layer.astype(np.int64) * 2 + kv) * 4096 + head) * (1 << 24) + token) * 4096 + dim + salt * 7919)
    with np.errstate(over="ignore"):
        x = (x.astype(np.uint64) * _MIX) >> np.uint64(24)
    return x.astype("<u8")[..., None].view(np.uint8)[..., :itemsize]


class Arena:
    """One host buffer holding many pools, so a fragment list executes as one vectorised gather."""

    def __init__(self, sizes: list[int], align: int = 256) -> None:
        offs, total = [], 0
        for s in sizes:
            offs.append(total)
            total += -(-s // align) * align
        self.buf = np.zeros(max(total, 1), dtype=np.uint8)
        self.base = int(self.buf.ctypes.data)
        self.offsets = offs

    def addr(self, i: int) -> int:
        return self.base + self.offsets[i]

    def view(self, i: int, nbytes: int) -> np.ndarray:
        return self.buf[self.offsets[i]:self.offsets[i] + nbytes]

    def execute(self, f: Fragments) -> None:
        """Copy every fragment (src -> dst, addresses inside this arena)."""
        if not len(f):
            return
        total = f.nbytes
        starts = np.cumsum(f.length) - f.length
        within = np.arange(total, dtype=np.int64) - np.repeat(starts, f.length)
        src = np.repeat(f.src - self.base, f.length) + within
        dst = np.repeat(f.dst - self.base, f.length) + within
        self.buf[dst] = self.buf[src]


def _image(layout: KVLayout, layers: range, heads: range, num_blocks: int, tok_of: np.ndarray,
           n_of: np.ndarray, salt_of: np.ndarray, background_salt: int) -> np.ndarray:
    """Codes of `layers` x `heads` of a pool, in the layout's memory order, shape [..., itemsize] (uint8)."""
    s = layout.shape
    L, H = np.arange(layers.start, layers.stop), np.arange(heads.start, heads.stop)
    K, T, D = np.arange(s.kv_factor), np.arange(s.tokens_per_block), np.arange(s.head_dim)
    B = np.arange(num_blocks)
    axes = order_axes(layout.order)  # e.g. "blkhn" (block_major); layer pools (l outermost) stacked in layer order
    grid = dict(zip(axes + "d", np.ix_(*({"l": L, "b": B, "k": K, "h": H, "n": T}[a] for a in axes), D)))
    b, l, k, h, t, d = (grid[a] for a in "blkhnd")
    tok = tok_of[b] + t
    real = (tok_of[b] >= 0) & (tok < n_of[b])
    codes = element_codes(l, k, h, np.where(real, tok, 0), d, s.itemsize, salt=salt_of[b] * 1000 + 17)
    background = element_codes(l, k, h, b * s.tokens_per_block + t, d, s.itemsize, salt=background_salt)
    return np.where(real[..., None], codes, background)


def _block_state(layout: KVLayout, num_blocks: int, requests) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    tpb = layout.shape.tokens_per_block
    tok_of = np.full(num_blocks, -1, dtype=np.int64)
    n_of = np.zeros(num_blocks, dtype=np.int64)
    salt_of = np.zeros(num_blocks, dtype=np.int64)
    for blocks, n, salt in requests:
        blocks = np.asarray(blocks, dtype=np.int64)[:-(-int(n) // tpb)]
        tok_of[blocks] = np.arange(blocks.size, dtype=np.int64) * tpb
        n_of[blocks], salt_of[blocks] = int(n), int(salt)
    return tok_of, n_of, salt_of


def pool_image(layout: KVLayout, rank: int, num_blocks: int, requests=(), background_salt: int = 1
               ) -> np.ndarray:
    """The bytes a rank's pool must hold (flat uint8).

    Args:
        layout: the executor's KV layout.
        rank: the rank whose pool this is (its pipeline stage's layers, its tensor-parallel heads).
        num_blocks: blocks in the pool.
        requests: (block_ids, num_tokens, salt) per request held in the pool: those tokens hold
            `element_codes` of (layer, kv, head, token, dim) salted with the request's salt.
        background_salt: every other byte holds codes salted with this (position-dependent, never zeros).
    """
    tp_rank, pp_rank = layout.coords(rank)
    img = _image(layout, layout.stage_layers(pp_rank), layout.head_range(tp_rank), num_blocks,
                 *_block_state(layout, num_blocks, requests), background_salt)
    return img.reshape(-1)


class _GlobalImage:
    """Every layer and head of an executor's pools at once (its ranks share block ids); sliced per rank."""

    def __init__(self, layout: KVLayout, num_blocks: int, requests, background_salt: int) -> None:
        s = layout.shape
        self.layout = layout
        self.img = _image(layout, range(s.num_layers), range(1 if s.mla else s.num_kv_heads), num_blocks,
                          *_block_state(layout, num_blocks, requests), background_salt)

    def rank(self, rank: int) -> np.ndarray:
        tp_rank, pp_rank = self.layout.coords(rank)
        ls, hs = self.layout.stage_layers(pp_rank), self.layout.head_range(tp_rank)
        axes = order_axes(self.layout.order)
        index = [slice(None)] * self.img.ndim
        index[axes.index("l")] = slice(ls.start, ls.stop)
        index[axes.index("h")] = slice(hs.start, hs.stop)
        return np.ascontiguousarray(self.img[tuple(index)]).reshape(-1)


def pool_nbytes(layout: KVLayout, rank: int, num_blocks: int) -> int:
    """Bytes of all of a rank's pool memory (every layer pool where the layer axis is outermost)."""
    return layout.block_bytes(rank) * num_blocks


def _pick_blocks(rng: np.random.Generator, pool: int, need: int) -> np.ndarray:
    """A run of adjacent ids (exercises coalescing) then scattered ones, never block 0 first."""
    run = need // 2
    rest = rng.permutation(np.arange(1 + run, pool))[:need - run]
    return np.concatenate([np.arange(1, 1 + run), rest]).astype(np.int64)


@dataclass
class VerifyResult:
    ok: bool
    strategy: str
    fragments: dict[int, int]  # generation rank -> fragment count after coalescing
    nbytes: int
    mismatches: dict[int, int]  # generation rank -> mismatching bytes

    def summary(self) -> str:
        frags = ", ".join(f"gen{r}:{n}" for r, n in self.fragments.items())
        bad = ", ".join(f"gen{r}:{n} bytes" for r, n in self.mismatches.items() if n)
        state = "OK" if self.ok else "MISMATCH " + bad
        return f"{state}  strategy={self.strategy}  bytes={self.nbytes}  fragments[{frags}]"


def verify_split(ctx: KVLayout, gen: KVLayout, num_tokens: int, *, seed: int = 0, path: str = "direct"
                 ) -> VerifyResult:
    """Move one request of `num_tokens` tokens from every context rank to every generation rank; compare.

    Args:
        ctx, gen: the two layouts (LayoutMismatchError / LayoutError if they cannot exchange KV).
        num_tokens: the request's length.
        seed: picks the block ids (a run of adjacent ones, then scattered ones) on both sides.
        path: "direct" (the generation rank's fragments, executed as they are) or "staged" (per piece: pack
            into a context-side staging buffer, one copy of the whole buffer, unpack on the generation side).
    Returns:
        VerifyResult: ok, the mapping strategy, fragments per generation rank (of the direct plan, or of the
        staged reads) and mismatching bytes per rank (request tokens in place, every other byte untouched).
    """
    if path not in ("direct", "staged"):
        raise ValueError(f"path must be 'direct' or 'staged', got {path!r}")
    rng = np.random.default_rng(seed)
    mapping = mapping_for(ctx, gen)
    tc, tg = ctx.shape.tokens_per_block, gen.shape.tokens_per_block
    nbc, nbg = -(-num_tokens // tc), -(-num_tokens // tg)
    nb_ctx, nb_gen = nbc + 3, nbg + 2  # spare blocks that must stay untouched
    ctx_blocks = _pick_blocks(rng, nb_ctx, nbc)
    gen_blocks = _pick_blocks(rng, nb_gen, nbg)
    arena, sizes, stage_at = _arena(ctx, gen, mapping, nb_ctx, nb_gen, num_tokens, path)

    def bases(layout: KVLayout, rank: int, i: int, nb: int) -> list[int]:
        if not layout.per_layer_pools:
            return [arena.addr(i)]
        per = int(np.prod(layout.pool_shape(rank, nb))) * layout.shape.itemsize
        return [arena.addr(i) + j * per for j in range(layout.local_layers(rank))]

    ctx_img = _GlobalImage(ctx, nb_ctx, [(ctx_blocks, num_tokens, 0)], background_salt=1)
    gen_before = _GlobalImage(gen, nb_gen, [], background_salt=2)
    gen_after = _GlobalImage(gen, nb_gen, [(gen_blocks, num_tokens, 0)], background_salt=2)
    ctx_pools = {}
    for r in range(ctx.world_size):
        ctx_pools[r] = RankPool.of(ctx, r, bases(ctx, r, r, nb_ctx), nb_ctx)
        arena.view(r, sizes[r])[:] = ctx_img.rank(r)
    frag_counts, mism, total = {}, {}, 0
    for g in range(gen.world_size):
        i = ctx.world_size + g
        arena.view(i, sizes[i])[:] = gen_before.rank(g)
        gpool = RankPool.of(gen, g, bases(gen, g, i, nb_gen), nb_gen)
        pieces = mapping.pieces(g)
        if path == "direct":
            frag_counts[g], moved = _move_direct(arena, pieces, ctx_pools, gpool, ctx_blocks, gen_blocks,
                                                 num_tokens)
        else:
            frag_counts[g], moved = _move_staged(arena, ctx, gen, pieces, [stage_at[(g, j)] for j in
                                                 range(len(pieces))], ctx_pools, gpool, ctx_blocks,
                                                 gen_blocks, num_tokens)
        total += moved
        mism[g] = int(np.count_nonzero(arena.view(i, sizes[i]) != gen_after.rank(g)))
    return VerifyResult(not any(mism.values()), mapping.strategy, frag_counts, total, mism)


def _arena(ctx: KVLayout, gen: KVLayout, mapping, nb_ctx: int, nb_gen: int, num_tokens: int, path: str):
    """One arena holding every rank's pool (context ranks first) and, staged, a pair of staging buffers per
    (generation rank, piece): (arena, sizes, {(gen rank, piece index): arena index of the context-side one})."""
    sizes = [pool_nbytes(ctx, r, nb_ctx) for r in range(ctx.world_size)]
    sizes += [pool_nbytes(gen, r, nb_gen) for r in range(gen.world_size)]
    stage_at = {}
    if path == "staged":
        for g in range(gen.world_size):
            for j, p in enumerate(mapping.pieces(g)):
                stage_at[(g, j)] = len(sizes)
                sizes += [staging_nbytes(ctx, p, num_tokens)] * 2  # context side, generation side
    return Arena(sizes), sizes, stage_at


def _move_direct(arena, pieces, ctx_pools, gpool, ctx_blocks, gen_blocks, num_tokens: int) -> tuple[int, int]:
    """The generation rank's direct plan, executed as it is: (fragments, bytes)."""
    per_ctx = plan_pieces(pieces, ctx_pools, gpool, ctx_blocks, gen_blocks, num_tokens)
    for f in per_ctx.values():
        arena.execute(f)
    return sum(len(f) for f in per_ctx.values()), sum(f.nbytes for f in per_ctx.values())


def _move_staged(arena, ctx, gen, pieces, stage_idx, ctx_pools, gpool, ctx_blocks, gen_blocks,
                 num_tokens: int) -> tuple[int, int]:
    """Per piece: pack on the context side, one read of the packed buffer, unpack: (fragments read, bytes)."""
    frags = moved = 0
    for p, k in zip(pieces, stage_idx):
        src = staging_pool(ctx, p, arena.addr(k), num_tokens)
        dst = staging_pool(gen, p, arena.addr(k + 1), num_tokens)
        arena.execute(plan_pack(p, ctx_pools[p.ctx_rank], src, ctx_blocks, num_tokens))
        read = staged_read(src, dst)
        arena.execute(read)
        arena.execute(plan_unpack(p, dst, gpool, gen_blocks, num_tokens))
        moved += read.nbytes
        frags += len(read)
    return frags, moved
