"""Gather/scatter staging: the alternative to many small direct reads when layouts regroup heads finely.

Direct path: the generation rank reads every fragment of a piece straight from the context pool (one
descriptor per contiguous run). When runs are small (e.g. one head of one layer of one 16-token block, 4 KiB)
a transfer is bound by per-descriptor cost, not bandwidth. Staged path: the context side PACKS the piece into
a contiguous staging buffer (local copies, one kernel/memcpy batch), the generation side READS that buffer as
one descriptor, then UNPACKS it into its pool (local copies).

Canonical staging order of a piece of one request (both sides agree on it without knowing each other's pool
layout): [layers, kv, heads, tokens, head_dim] over the piece's global layers, its kv heads, and the request's
tokens [0, n); kv has extent 1 for MLA. Layers are outermost, so the layers ready so far are a contiguous
prefix of the buffer (layer-by-layer pipelining reads a growing prefix).

A staging buffer is described to the planner as a RankPool of ONE block of n tokens whose extent is the
piece, so packing and unpacking are ordinary plans (`plan_piece`) — same vectorised code, same checks.
A token range (prefix reuse: `first_token` > 0) stages only tokens [first_token, n): the buffer holds n -
first_token tokens per (layer, kv, head) row and its pool's base is shifted back by first_token rows, so the
planner's absolute token positions land inside it.

Owns only address arithmetic and the path choice; never allocates, registers or copies memory.
"""

from __future__ import annotations

import numpy as np

from ..agents import MemoryKind
from ..errors import PlanError
from .layout import KVLayout, PoolAddressing
from .mapping import Piece
from .planner import Fragments, RankPool, plan_piece

__all__ = ["DEFAULT_THRESHOLD_BYTES", "MIN_STAGED_FRAGMENTS", "staging_nbytes", "layer_range", "staging_pool",
           "plan_pack", "plan_unpack", "staged_read", "choose_path", "many_small"]

# Direct reads are worth it while one descriptor's bytes take longer on the wire than its fixed cost:
# a descriptor costs ~0.5 us of CPU to submit to the copy engine (cuMemcpyBatchAsync, vLLM PR #48434) and
# ~1-2 us end to end through NIXL/UCX when descriptors are many (vLLM #53825: 16 KB descriptors ran at 9 GB/s
# on a 50 GB/s link); at 25-50 GB/s per rank the break-even size c * B is ~12-80 KiB. Packing and unpacking
# cost two local copies at HBM speed (~1-3 TB/s, i.e. a few percent of the wire time) plus two kernel
# launches, so below ~32 KiB mean fragment size the staged path wins.
DEFAULT_THRESHOLD_BYTES = 32 << 10
# Below this many fragments the fixed cost of staging (two launches, an extra completion round trip, ~10-20
# us) exceeds what the descriptors cost (64 x ~0.5 us), whatever their size.
MIN_STAGED_FRAGMENTS = 64


def _check_piece(layout: KVLayout, piece: Piece, num_tokens: int, first_token: int = 0) -> None:
    s = layout.shape
    heads = 1 if s.mla else s.num_kv_heads
    if not piece.layers or piece.layers.start < 0 or piece.layers.stop > s.num_layers:
        raise PlanError(f"{piece!r}: layers outside the model's 0..{s.num_layers - 1}")
    if not piece.heads or piece.heads.start < 0 or piece.heads.stop > heads:
        raise PlanError(f"{piece!r}: kv heads outside the model's 0..{heads - 1}")
    if int(num_tokens) <= 0:
        raise PlanError(f"a request needs at least one token, got {num_tokens}")
    if not 0 <= int(first_token) < int(num_tokens):
        raise PlanError(f"first token {first_token} to stage is outside the request's {num_tokens} tokens")


def staging_nbytes(layout: KVLayout, piece: Piece, num_tokens: int, first_token: int = 0) -> int:
    """Bytes of the staging buffer of `piece` of a request's tokens [first_token, num_tokens)."""
    _check_piece(layout, piece, num_tokens, first_token)
    s = layout.shape
    n = int(num_tokens) - int(first_token)
    return len(piece.layers) * s.kv_factor * len(piece.heads) * n * s.head_dim * s.itemsize


def layer_range(piece: Piece, layers: range, layout: KVLayout, num_tokens: int,
                first_token: int = 0) -> tuple[Piece, int, int]:
    """The part of `piece` in global `layers` as (sub-piece, byte offset in the piece's slot, bytes). The
    canonical order is layer-major, so any layer range of a piece is one contiguous byte range of its slot."""
    lo, hi = max(layers.start, piece.layers.start), min(layers.stop, piece.layers.stop)
    if hi <= lo:
        raise ValueError(f"layers {layers} hold nothing of {piece!r}")
    sub = Piece(piece.ctx_rank, range(lo, hi), piece.heads)
    per = staging_nbytes(layout, Piece(piece.ctx_rank, range(lo, lo + 1), piece.heads), num_tokens, first_token)
    return sub, (lo - piece.layers.start) * per, (hi - lo) * per


def staging_pool(layout: KVLayout, piece: Piece, base: int, num_tokens: int,
                 kind: MemoryKind = MemoryKind.DRAM, device: int = 0, first_token: int = 0) -> RankPool:
    """The staging buffer at `base` as a pool of one block of `num_tokens` tokens holding exactly `piece`.

    Args:
        layout: either side's layout (only the KV shape is used; both sides' shapes agree).
        piece: the global layers and kv heads staged.
        base: address of the buffer (staging_nbytes bytes).
        num_tokens: the request's token count.
        kind, device: where the buffer lives.
        first_token: the buffer holds only tokens [first_token, num_tokens) (plan with the same first_token).
    Returns:
        A RankPool usable as either side of `plan_piece` with block ids [0].
    """
    _check_piece(layout, piece, num_tokens, first_token)
    s = layout.shape
    n, row, first = int(num_tokens), s.head_dim * s.itemsize, int(first_token)
    H, L = len(piece.heads), len(piece.layers)
    token, head = row, (n - first) * row
    kv = H * head
    layer = s.kv_factor * kv
    layer_base = np.int64(base) - first * row + np.arange(L, dtype=np.int64) * layer
    addressing = PoolAddressing(layer_base, L * layer, kv, head, token, 1, row)
    return RankPool(layout, piece.ctx_rank, addressing, kind, device, tokens_per_block=n,
                    extent=(piece.layers, piece.heads))


_ZERO = np.zeros(1, dtype=np.int64)


def plan_pack(piece: Piece, ctx: RankPool, staging: RankPool, ctx_blocks, num_tokens: int,
              first_token: int = 0) -> Fragments:
    """Local copies that gather `piece` of a request from the context pool into its staging buffer."""
    return plan_piece(piece, ctx, staging, ctx_blocks, _ZERO, num_tokens, first_token)


def plan_unpack(piece: Piece, staging: RankPool, gen: RankPool, gen_blocks, num_tokens: int,
                first_token: int = 0) -> Fragments:
    """Local copies that scatter `piece` from its staging buffer into the generation pool's blocks."""
    return plan_piece(piece, staging, gen, _ZERO, gen_blocks, num_tokens, first_token)


def staged_read(src: RankPool, dst: RankPool) -> Fragments:
    """The single descriptor that moves a whole staging buffer (context side) to another (generation side)."""
    a, b = src.addressing, dst.addressing
    if src.extent != dst.extent or src.tpb != dst.tpb or a.block_stride != b.block_stride:
        raise PlanError(f"staging buffers differ: {src.extent} x {src.tpb} tokens vs {dst.extent} x "
                        f"{dst.tpb}")
    one = np.ones(1, dtype=np.int64)
    return Fragments(one * int(a.layer_base[0]), one * int(b.layer_base[0]), one * a.block_stride)


def choose_path(fragments: Fragments, threshold_bytes: int = DEFAULT_THRESHOLD_BYTES,
                min_fragments: int = MIN_STAGED_FRAGMENTS) -> str:
    """Pick the direct or the staged path for a piece whose direct plan is `fragments`.

    Args:
        fragments: the direct plan (after coalescing).
        threshold_bytes: staged when the mean fragment is smaller than this (see DEFAULT_THRESHOLD_BYTES).
        min_fragments: never staged with fewer fragments than this (staging's fixed cost would dominate).
    Returns:
        "staged" or "direct".
    """
    return "staged" if many_small(len(fragments), fragments.nbytes, threshold_bytes, min_fragments) else "direct"


def many_small(count: int, nbytes: int, threshold_bytes: int, min_fragments: int) -> bool:
    """The staged path's one rule: at least `min_fragments` (and 2) fragments whose mean size is below
    `threshold_bytes` (0: none is). `choose_path`, the transceiver's per-piece choice and its hint after a
    direct read all ask this."""
    return count >= max(min_fragments, 2) and nbytes < count * threshold_bytes
