"""vLLM's KV cache tensors as kvbridge sees them: a KVLayout, this worker's rank and pool, positional digests.

vLLM hands a worker one tensor per attention layer (`register_kv_caches`). Their shape and strides depend on
the attention backend; this module names the physical order (formatter/layout.py: a permutation of
"lbkhn") and checks every stride against it, so a cache kvbridge does not understand is refused by name at
start instead of moved wrongly. Known shapes per layer:
    CPU backend           [blocks, heads, tokens, 2 * head_dim]: per (block, head) a K region of block_size x
                          head_dim elements, then a V region of the same size ("lbhkn" at region granularity)
    flash-attention like  [2, blocks, tokens, heads, head_dim] or [blocks, 2, tokens, heads, head_dim], any
                          stride order (NHD / HND)
    MLA                   [blocks, tokens, latent]
Inside a region the CPU backend packs elements its own way (packing.py: learned from the kernel): so kvbridge
moves whole (block, head, K|V) regions (`moved_tokens`), never token rows — straight into vLLM's blocks when
both engines use one block size, through a staging pool and a repack when they differ (reblock.py) — and the
positional digest unpacks regions to token rows first. Owns no memory: the tensors stay vLLM's. Imports
torch, never vllm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np
import torch
import xxhash

from ...errors import LayoutError
from ...formatter.layout import KVLayout, KVShape, ParallelSplit, PoolAddressing
from .packing import ELEMENT_INT, Packing, unpack

__all__ = ["EngineShape", "CachePool", "describe_caches", "kv_digest", "moved_tokens", "PACKED_ORDERS",
           "DTYPE_NAMES", "GRANULE"]

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
               torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2", torch.int8: "int8",
               torch.uint8: "uint8"}
# orders whose (block, head, K|V) regions an engine packs its own way: moved as whole regions, same block size
PACKED_ORDERS = frozenset({"lbhkn"})
GRANULE = 32  # tokens per positional digest key (every CPU-backend block size is a multiple of it)
# logical axis labels of a 5-D per-layer cache, in the backends' shape order; the first that fits wins
_FIVE_D = ("kbnh", "bknh", "kbhn", "bkhn")


@dataclass(frozen=True)
class EngineShape:
    """What vLLM's config says about the model's KV cache and its split (filled by connector.py)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    tp: int
    pp: int
    layers_per_stage: tuple[int, ...]
    mla: bool = False


@dataclass(frozen=True)
class CachePool:
    """This worker's share of the KV cache: layout, kvbridge rank, one tensor per local layer in order."""

    layout: KVLayout
    rank: int
    buffers: tuple[torch.Tensor, ...]
    num_blocks: int

    @property
    def addressing(self) -> PoolAddressing:
        return PoolAddressing.for_rank(self.layout, self.rank, [b.data_ptr() for b in self.buffers],
                                       self.num_blocks)


def moved_tokens(num_tokens: int, layout: KVLayout) -> int:
    """Tokens a request of `num_tokens` moves in `layout`: whole blocks, the last one included, for a packed
    order (PACKED_ORDERS); exactly `num_tokens` otherwise."""
    if layout.order not in PACKED_ORDERS:
        return int(num_tokens)
    tpb = layout.shape.tokens_per_block
    return -(-int(num_tokens) // tpb) * tpb


def describe_caches(shape: EngineShape, tp_rank: int, pp_rank: int, kv_caches: Mapping[str, torch.Tensor],
                    layer_index: Callable[[str], int]) -> CachePool:
    """The CachePool of one vLLM worker; LayoutError naming the tensor when its shape or strides are unknown."""
    if not kv_caches:
        raise LayoutError("vLLM registered no KV cache tensors")
    names = sorted(kv_caches, key=layer_index)
    split = ParallelSplit(shape.tp, shape.pp, shape.layers_per_stage)
    first = kv_caches[names[0]]
    dtype = DTYPE_NAMES.get(first.dtype)
    if dtype is None:
        raise LayoutError(f"vLLM KV cache dtype {first.dtype} has no kvbridge name ({sorted(DTYPE_NAMES.values())})")
    kshape = KVShape(shape.num_layers, 1 if shape.mla else shape.num_kv_heads,
                     shape.head_dim, dtype, shape.block_size, shape.mla)
    probe = KVLayout(kshape, split)
    rank = probe.rank_of(tp_rank, pp_rank)
    stage = probe.stage_layers(pp_rank)
    got = [layer_index(n) for n in names]
    if got != list(stage):
        raise LayoutError(f"vLLM worker (tp {tp_rank}, pp {pp_rank}) holds layers {got}; kvbridge's split of "
                          f"{shape.num_layers} layers over PP{shape.pp} gives it {list(stage)}")
    order = _order_of(first, kshape, probe.local_kv_heads, names[0])
    layout = KVLayout(kshape, split, order)
    buffers = tuple(kv_caches[n] for n in names)
    num_blocks = _num_blocks(first, order)
    pool = CachePool(layout, rank, buffers, num_blocks)
    for n, t in zip(names, buffers):
        if t.dtype != first.dtype or tuple(t.shape) != tuple(first.shape) or t.stride() != first.stride():
            raise LayoutError(f"vLLM KV cache {n}: {tuple(t.shape)} {t.dtype} strides {t.stride()} differs from "
                              f"{names[0]}: {tuple(first.shape)} {first.dtype} strides {first.stride()}")
    e = first.element_size()
    span = layout.block_bytes(rank) // layout.local_layers(rank) * num_blocks
    for n, t in zip(names, buffers):
        if t.untyped_storage().nbytes() < span or t.numel() * e != span:
            raise LayoutError(f"vLLM KV cache {n} is not one contiguous region of {span} bytes")
    return pool


def _order_of(t: torch.Tensor, s: KVShape, heads: int, name: str) -> str:
    """The physical order ("l" + a permutation of "bkhn") whose strides are exactly `t`'s."""
    e, dims, strides = t.element_size(), tuple(t.shape), t.stride()
    labels: list[str] = []
    if s.mla and len(dims) == 3 and dims[1:] == (s.tokens_per_block, s.head_dim):
        labels = ["bn"]
    elif len(dims) == 4 and dims[1:] == (heads, s.tokens_per_block, 2 * s.head_dim):
        # CPU: [B, H, T, 2D] viewed by the backend as [B, H, 2T, D] and split in two along tokens
        if strides == (heads * s.tokens_per_block * 2 * s.head_dim, s.tokens_per_block * 2 * s.head_dim,
                       2 * s.head_dim, 1):
            return "lbhkn"
    elif len(dims) == 5 and dims[-1] == s.head_dim:
        size = {"k": 2, "h": heads, "n": s.tokens_per_block}
        labels = [lab for lab in _FIVE_D if all(dims[i] == size[c] for i, c in enumerate(lab) if c != "b")]
    for lab in labels:
        if strides[-1] != 1:
            break
        physical = "".join(c for _, c in sorted(zip(strides[:-1], lab), key=lambda p: -p[0]))
        order = "l" + physical + ("kh" if s.mla else "")
        lay = KVLayout(s, ParallelSplit(), order)
        nb = dims[lab.index("b")]
        a = PoolAddressing.for_rank(lay, 0, [0] * s.num_layers, nb)
        stride_of = {"b": a.block_stride, "k": a.kv_stride, "h": a.head_stride, "n": a.token_stride}
        if all(strides[i] * e == stride_of[c] for i, c in enumerate(lab)):
            return order
    raise LayoutError(f"vLLM KV cache {name}: shape {dims}, strides {strides} ({t.dtype}) is not a layout kvbridge "
                      f"knows for {heads} local kv heads of head_dim {s.head_dim}, {s.tokens_per_block} tokens per "
                      f"block (known: CPU [blocks, heads, tokens, 2*head_dim]; [2, blocks, tokens, heads, head_dim] "
                      f"and its permutations; MLA [blocks, tokens, latent])")


def _num_blocks(t: torch.Tensor, order: str) -> int:
    if order == "lbhkn" and t.dim() == 4:
        return int(t.shape[0])
    if t.dim() == 3:
        return int(t.shape[0])
    sizes = sorted(((s, d) for s, d in zip(t.stride()[:-1], t.shape[:-1])), key=lambda p: -p[0])
    return int(sizes[order[1:].index("b")][1])


def kv_digest(pool: CachePool, block_ids, num_tokens: int, packing: Packing | None = None) -> dict[str, str]:
    """Positional digest of one request on this worker: "layer.head.K|V.g" (global layer and head ids, g the
    g-th granule of GRANULE tokens in token order) -> xxh3-64 of those tokens' rows of that head, read as
    token rows (a packed cache is unpacked with its kernel's `packing` first). Two engines agree on every key
    exactly when every token's KV sits where it belongs, whatever their TP split and block sizes; keys from
    g on compare a partial pull."""
    lay, a = pool.layout, pool.addressing
    T, n = lay.shape.tokens_per_block, int(num_tokens)
    nb = -(-n // T)
    blocks = torch.as_tensor(np.asarray(block_ids, dtype=np.int64)[:nb])
    tp_rank, pp_rank = lay.coords(pool.rank)
    out: dict[str, str] = {}
    for li, layer in enumerate(lay.stage_layers(pp_rank)):
        buf = pool.buffers[li].detach()
        if lay.order in PACKED_ORDERS:
            if packing is None:
                raise LayoutError(f"a digest of a {lay.order} cache needs its kernel's packing")
            regions = buf.view(ELEMENT_INT[buf.element_size()]).view(buf.shape[0], buf.shape[1], 2, -1)
            rows = unpack(regions.index_select(0, blocks.to(buf.device)), packing)
            heads = rows.permute(1, 2, 0, 3, 4).reshape(buf.shape[1], 2, nb * T, -1)[:, :, :n]
        else:
            flat = buf.reshape(-1).view(torch.uint8)
            heads = torch.stack([torch.stack([
                torch.as_strided(flat, (a.num_blocks, T, a.row_bytes), (a.block_stride, a.token_stride, 1),
                                 flat.storage_offset() + k * a.kv_stride + hi * a.head_stride)
                .index_select(0, blocks.to(buf.device)).reshape(nb * T, a.row_bytes)[:n]
                for k in range(lay.shape.kv_factor)]) for hi in range(len(lay.head_range(tp_rank)))])
        host = heads.cpu().contiguous().numpy()
        for hi, head in enumerate(lay.head_range(tp_rank)):
            for k in range(lay.shape.kv_factor):
                for g in range(0, n, GRANULE):
                    key = f"{layer}.{head}.{'KV'[k]}.{g // GRANULE}"
                    out[key] = xxhash.xxh3_64_hexdigest(host[hi, k, g:g + GRANULE])
    return out
