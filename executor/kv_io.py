"""A request's KV as plain tensors: read out of / write into a rank's pool, shard and assemble across ranks.

Owns the canonical per-request form [layers, kv_factor, kv_heads, tokens, head_dim] and its per-rank shard
[local_layers, kv_factor, local_kv_heads, tokens, head_dim]. For tests and tools (comparing the KV that a
transfer delivered with the KV the context side computed); transfers themselves never go through here.
"""

from __future__ import annotations

import torch

from ..errors import ExecutorError
from ..formatter.layout import KVLayout

__all__ = ["gather_blocks", "scatter_blocks", "shard_of", "assemble"]


def gather_blocks(pool: torch.Tensor, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """The first `num_tokens` tokens held in `block_ids` of a block_major pool, as one rank's shard.

    Args:
        pool: [num_blocks, local_layers, kv_factor, local_heads, tokens_per_block, head_dim].
        block_ids: the request's blocks, in token order.
        num_tokens: tokens to keep.
    Returns:
        a new contiguous tensor [local_layers, kv_factor, local_heads, num_tokens, head_dim] on pool's device.
    """
    nb, T = len(block_ids), pool.shape[4]
    if num_tokens > nb * T:
        raise ExecutorError(f"{num_tokens} tokens do not fit in {nb} blocks of {T}")
    x = pool[torch.tensor(block_ids, dtype=torch.int64, device=pool.device)]
    _, L, K, H, _, D = x.shape
    return x.permute(1, 2, 3, 0, 4, 5).reshape(L, K, H, nb * T, D)[:, :, :, :num_tokens].contiguous()


def scatter_blocks(pool: torch.Tensor, block_ids: list[int], shard: torch.Tensor) -> None:
    """Write a shard [local_layers, kv_factor, local_heads, tokens, head_dim] into `block_ids` of the pool
    (the tail of the last block is zero-filled)."""
    nb, T = len(block_ids), pool.shape[4]
    L, K, H, n, D = shard.shape
    if (L, K, H, D) != (pool.shape[1], pool.shape[2], pool.shape[3], pool.shape[5]) or n > nb * T:
        raise ExecutorError(f"a KV shard of shape {tuple(shard.shape)} does not fit {nb} blocks of a pool "
                            f"{tuple(pool.shape)}")
    full = torch.zeros((L, K, H, nb * T, D), dtype=pool.dtype, device=pool.device)
    full[:, :, :, :n] = shard.to(device=pool.device, dtype=pool.dtype)
    pool[torch.tensor(block_ids, dtype=torch.int64, device=pool.device)] = \
        full.reshape(L, K, H, nb, T, D).permute(3, 0, 1, 2, 4, 5)


def shard_of(layout: KVLayout, rank: int, kv: torch.Tensor) -> torch.Tensor:
    """The part of a whole request KV [layers, kv_factor, kv_heads, tokens, head_dim] that `rank` holds."""
    tp_rank, pp_rank = layout.coords(rank)
    layers, heads = layout.stage_layers(pp_rank), layout.head_range(tp_rank)
    return kv[layers.start:layers.stop, :, heads.start:heads.stop].contiguous()


def assemble(layout: KVLayout, shards: dict[int, torch.Tensor]) -> torch.Tensor:
    """The whole request KV from every rank's shard; replicated heads must be equal on every rank."""
    if set(shards) != set(range(layout.world_size)):
        raise ExecutorError(f"assemble needs a shard from every rank 0..{layout.world_size - 1}, got "
                            f"{sorted(shards)}")
    s = layout.shape
    first = shards[0]
    out = torch.empty((s.num_layers, s.kv_factor, s.num_kv_heads, first.shape[3], s.head_dim),
                      dtype=first.dtype)
    seen = torch.zeros((s.num_layers, s.num_kv_heads), dtype=torch.bool)
    for r in sorted(shards):
        x = shards[r].cpu()
        tp_rank, pp_rank = layout.coords(r)
        layers, heads = layout.stage_layers(pp_rank), layout.head_range(tp_rank)
        ls, hs = slice(layers.start, layers.stop), slice(heads.start, heads.stop)
        if tuple(x.shape) != (len(layers), s.kv_factor, len(heads), first.shape[3], s.head_dim):
            raise ExecutorError(f"rank {r}'s shard has shape {tuple(x.shape)}, its layout slice is "
                                f"{(len(layers), s.kv_factor, len(heads), first.shape[3], s.head_dim)}")
        if seen[ls, hs].all():
            if not torch.equal(out[ls, :, hs], x):
                raise ExecutorError(f"rank {r}'s replica of kv heads {list(heads)} differs from another "
                                    f"rank's")
            continue
        out[ls, :, hs] = x
        seen[ls, hs] = True
    return out
