"""Checksums of a request's KV in a canonical order, so both sides of a transfer can compare what they hold.

For a piece (layer range, head range) of a request, the canonical bytes of one layer are its elements in
[kv, head, token, head_dim] order over the request's tokens, whatever the pool's memory order or block size.
Context and generation ranks each hash their own copy; equal digests mean the transfer was exact. Used by
the transceiver's optional verification mode (a silent corruption becomes a failed transfer).

Works on host (numpy) and CUDA (torch) pools through strided views of the pool memory; one digest per layer.
"""

from __future__ import annotations

import numpy as np
import torch
import xxhash

from .mapping import Piece
from .planner import RankPool

__all__ = ["piece_digests", "as_bytes"]


def as_bytes(buffer) -> torch.Tensor:
    """A flat uint8 torch view of a contiguous pool buffer (numpy array or tensor), no copy."""
    t = torch.from_numpy(buffer) if isinstance(buffer, np.ndarray) else buffer
    return t.reshape(-1).view(torch.uint8)


def piece_digests(buffers: list, pool: RankPool, piece: Piece, blocks, num_tokens: int,
                  first_token: int = 0) -> list[bytes]:
    """xxh3-64 digest per layer of `piece` of a request held in `pool` (its `buffers`, in region order).

    Args:
        buffers: the pool's memory, one flat-viewable buffer per registered region (see LocalPool.buffers).
        pool: the rank's RankPool (layout, rank, addressing).
        piece: global layer and head ranges to hash.
        blocks: the request's block ids in this pool.
        num_tokens: the request's token count.
        first_token: hash only tokens [first_token, num_tokens) (what a partial pull read).
    """
    lay, a = pool.layout, pool.addressing
    tp_rank, pp_rank = lay.coords(pool.rank)
    tpb = lay.shape.tokens_per_block
    nblk = -(-int(num_tokens) // tpb)
    idx = torch.as_tensor(np.asarray(blocks, dtype=np.int64)[:nblk])
    flats = [as_bytes(b) for b in buffers]
    bases = [int(f.data_ptr()) for f in flats]
    h0 = piece.heads.start - lay.head_range(tp_rank).start
    nh = len(piece.heads)
    out = []
    for layer in piece.layers:
        base = int(a.layer_base[layer - lay.stage_layers(pp_rank).start])
        r = max(i for i, b in enumerate(bases) if b <= base)
        view = torch.as_strided(flats[r], (a.num_blocks, lay.shape.kv_factor, nh, tpb, a.row_bytes),
                                (a.block_stride, a.kv_stride, a.head_stride, a.token_stride, 1),
                                base - bases[r] + h0 * a.head_stride)
        sel = view.index_select(0, idx.to(view.device))  # [nblk, K, H, T, row]
        canon = sel.permute(1, 2, 0, 3, 4).reshape(lay.shape.kv_factor, nh, nblk * tpb, a.row_bytes)
        canon = canon[:, :, int(first_token):num_tokens].contiguous().cpu().numpy()
        out.append(xxhash.xxh3_64_digest(canon.tobytes()))
    return out
