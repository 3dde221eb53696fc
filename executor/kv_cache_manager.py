"""Paged KV cache manager of one rank: the pool tensor, block allocation per request, pinning.

Owns ONE pool tensor per rank, `layout.pool_shape(rank, num_blocks)` in "block_major" order
`[num_blocks, local_layers, kv_factor, local_kv_heads, tokens_per_block, head_dim]`, contiguous, so a
transfer agent registers it once. Hands out block ids to requests and takes them back. Never moves KV
itself and never talks to other ranks: the engine decides, every rank applies the same operations.

The method names follow TensorRT-LLM's KVCacheManager (pyexecutor/resource_manager.py); arguments are
adapted to kvbridge's own requests (plain request ids and token counts):

    prepare_resources(needs)        before a step: make sure each (request_id, num_tokens) has the blocks
                                    for num_tokens tokens (new requests get their first blocks). All or
                                    nothing: on exhaustion nothing is allocated and KVCacheExhausted says so.
    update_resources(done)          after a step: record how many tokens each request now holds in cache.
    free_resources(request_id)      the request is finished; its blocks return to the free list, or, while
                                    it is pinned, when the last pin is dropped.
    pin(request_id) / unpin(...)    an outgoing transfer holds the blocks: they are neither freed nor reused
                                    until the last unpin.
    add_sequence_for_transfer(...)  generation-only: blocks for a prompt whose KV arrives from elsewhere;
    mark_ready(request_id)          ...and the KV has arrived, the request may decode.

Every misuse (unknown request, double free, unpinning an unpinned request) raises a KVCacheError subclass;
nothing is a silent no-op, and a refused call leaves the manager exactly as it was.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

import torch

from ..errors import KVCacheError, KVCacheExhausted
from ..formatter.layout import KVLayout

__all__ = ["KVCacheManager", "SeqState", "TORCH_DTYPES"]

TORCH_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float8_e4m3fn": getattr(torch, "float8_e4m3fn", torch.uint8),
    "float8_e5m2": getattr(torch, "float8_e5m2", torch.uint8), "int8": torch.int8, "uint8": torch.uint8,
}


class SeqState:
    """A sequence's state in the manager (plain strings, so they show in messages)."""

    ACTIVE = "active"            # computing or decoding in this executor
    AWAITING_KV = "awaiting_kv"  # generation-only: blocks handed out, KV not yet arrived
    PADDING = "padding"          # a dummy request that pads a batch


@dataclass
class _Seq:
    blocks: list[int]
    num_tokens: int = 0          # tokens whose KV is in the cache
    state: str = SeqState.ACTIVE
    pins: int = 0
    freed: bool = False          # free_resources was called while pinned: free on the last unpin
    extra: dict = field(default_factory=dict)


class KVCacheManager:
    """Block allocator and pool of one rank.

    Args:
        layout: the executor's KV layout (order must be "block_major").
        rank: this rank's global id (pp_rank * tp + tp_rank).
        num_blocks: blocks in the pool.
        device: where the pool lives ("cpu", "cuda:0", ...).
        max_blocks_per_seq: refuse a single request needing more blocks than this (default: num_blocks).
    """

    def __init__(self, layout: KVLayout, rank: int, num_blocks: int, *, device: str | torch.device = "cpu",
                 max_blocks_per_seq: int | None = None) -> None:
        if layout.order != "block_major":
            raise KVCacheError(f"the executor's pool must be 'block_major', got {layout.order!r}")
        if num_blocks <= 0:
            raise KVCacheError(f"num_blocks must be positive, got {num_blocks}")
        self.layout = layout
        self.rank = rank
        self.num_blocks = int(num_blocks)
        self.tokens_per_block = layout.shape.tokens_per_block
        self.max_blocks_per_seq = int(max_blocks_per_seq or num_blocks)
        self.pool = torch.zeros(layout.pool_shape(rank, num_blocks), dtype=TORCH_DTYPES[layout.shape.dtype],
                                device=device)
        self._free: deque[int] = deque(range(self.num_blocks))
        self._seqs: dict[int, _Seq] = {}

    # --- queries ------------------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-int(num_tokens) // self.tokens_per_block)

    def get_max_resource_count(self) -> int:
        """Total blocks in the pool."""
        return self.num_blocks

    def get_num_free_blocks(self) -> int:
        """Blocks on the free list (pinned blocks of freed requests are not free yet)."""
        return len(self._free)

    def get_needed_resource_to_completion(self, total_tokens: int, request_id: int | None = None) -> int:
        """Blocks still to allocate for a request to reach `total_tokens` (prompt + max new tokens).

        Args:
            total_tokens: tokens the request will hold when it finishes.
            request_id: an existing request (its blocks count as held), or None for a new one.
        """
        held = len(self._get(request_id).blocks) if request_id is not None else 0
        return max(0, self.blocks_for(total_tokens) - held)

    def get_batch_cache_indices(self, request_ids: Iterable[int]) -> list[list[int]]:
        """Block ids of each request, in token order."""
        return [list(self._get(r).blocks) for r in request_ids]

    def block_table(self, request_ids: Iterable[int],
                    device: str | torch.device | None = None) -> torch.Tensor:
        """Block ids as an int64 tensor [batch, max_blocks], padded with 0 (padding is never read)."""
        rows = self.get_batch_cache_indices(request_ids)
        width = max((len(r) for r in rows), default=0) or 1
        out = torch.zeros((len(rows), width), dtype=torch.int64)
        for i, r in enumerate(rows):
            out[i, :len(r)] = torch.tensor(r, dtype=torch.int64)
        return out.to(device or self.pool.device)

    def num_tokens(self, request_id: int) -> int:
        return self._get(request_id).num_tokens

    def state(self, request_id: int) -> str:
        return self._get(request_id).state

    def __contains__(self, request_id: int) -> bool:
        s = self._seqs.get(request_id)
        return s is not None and not s.freed

    def request_ids(self) -> list[int]:
        """Live (not freed) requests."""
        return [r for r, s in self._seqs.items() if not s.freed]

    def get_buffers(self, layer: int) -> torch.Tensor:
        """A view of local layer `layer`: [num_blocks, kv_factor, tokens_per_block, local_kv_heads, head_dim].

        Args:
            layer: the local layer index (0 .. local_layers - 1), not the global layer id.
        Returns:
            a permuted VIEW of the pool (writes go to the pool; it is not contiguous).
        """
        if not 0 <= layer < self.pool.shape[1]:
            raise KVCacheError(f"local layer {layer} outside 0..{self.pool.shape[1] - 1} on rank {self.rank}")
        return self.pool[:, layer].permute(0, 1, 3, 2, 4)

    # --- allocation -----------------------------------------------------------------------------------
    def prepare_resources(self, needs: Iterable[tuple[int, int]]) -> None:
        """Give each (request_id, num_tokens) the blocks to hold num_tokens tokens; new ids become requests.

        All or nothing: if the pool cannot cover every request, nothing is allocated.
        Raises:
            KVCacheExhausted: too few free blocks (the message gives needed and free counts).
            KVCacheError: a request is freed, padding-only or awaiting KV.
        """
        needs = list(needs)
        want = 0
        for rid, n in needs:
            s = self._seqs.get(rid)
            if s is not None and s.freed:
                raise KVCacheError(f"request {rid} was already freed; it cannot grow")
            held = len(s.blocks) if s is not None else 0
            nb = self.blocks_for(n)
            if nb > self.max_blocks_per_seq:
                raise KVCacheExhausted(f"request {rid} needs {nb} blocks for {n} tokens, more than the "
                                       f"{self.max_blocks_per_seq} one request may hold")
            want += max(0, nb - held)
        if want > len(self._free):
            raise KVCacheExhausted(f"{want} more blocks needed for requests {[r for r, _ in needs]}, "
                                   f"only {len(self._free)} of {self.num_blocks} free; request refused")
        for rid, n in needs:
            s = self._seqs.get(rid)
            if s is None:
                s = self._seqs[rid] = _Seq(blocks=[])
            for _ in range(self.blocks_for(n) - len(s.blocks)):
                s.blocks.append(self._free.popleft())

    def add_sequence(self, request_id: int, num_tokens: int) -> list[int]:
        """A new request holding `num_tokens` tokens; returns its block ids.

        Raises:
            KVCacheError: the id is already in use.
            KVCacheExhausted: the pool is too full (nothing allocated).
        """
        if request_id in self._seqs:
            raise KVCacheError(f"request {request_id} already has blocks on rank {self.rank}")
        self.prepare_resources([(request_id, max(1, num_tokens))])
        return list(self._seqs[request_id].blocks)

    def add_sequence_for_transfer(self, request_id: int, prompt_len: int) -> list[int]:
        """Generation-only: blocks for a prompt whose KV will be written by a transfer; returns block ids.

        The request stays AWAITING_KV (the engine must not decode it) until `mark_ready`.
        """
        blocks = self.add_sequence(request_id, prompt_len)
        s = self._seqs[request_id]
        s.state = SeqState.AWAITING_KV
        s.num_tokens = int(prompt_len)
        return blocks

    def mark_ready(self, request_id: int) -> None:
        """The prompt KV of a generation-only request has arrived; it may decode now."""
        s = self._get(request_id)
        if s.state != SeqState.AWAITING_KV:
            raise KVCacheError(f"request {request_id} is {s.state}, not awaiting KV; cannot mark it ready")
        s.state = SeqState.ACTIVE

    def add_padding_request(self, request_id: int, num_tokens: int = 1) -> list[int]:
        """A dummy request that pads a batch (e.g. to a CUDA-graph size); free it like any other."""
        blocks = self.add_sequence(request_id, num_tokens)
        self._seqs[request_id].state = SeqState.PADDING
        return blocks

    def update_resources(self, done: Iterable[tuple[int, int]]) -> None:
        """After a step: each (request_id, num_tokens) now holds num_tokens tokens of KV in its blocks."""
        for rid, n in done:
            s = self._get(rid)
            if self.blocks_for(n) > len(s.blocks):
                raise KVCacheError(f"request {rid} holds {len(s.blocks)} blocks, too few for {n} tokens")
            s.num_tokens = int(n)

    def free_resources(self, request_id: int) -> None:
        """The request is finished: free its blocks now, or at the last unpin while it is pinned.

        Raises:
            KVCacheError: unknown request, or already freed (a double free).
        """
        s = self._seqs.get(request_id)
        if s is None:
            raise KVCacheError(f"free of unknown request {request_id} on rank {self.rank} (never allocated, "
                               f"or "
                               f"already freed and released)")
        if s.freed:
            raise KVCacheError(f"double free of request {request_id} on rank {self.rank} (its free is "
                               f"pending "
                               f"on {s.pins} pin(s))")
        s.freed = True
        if s.pins == 0:
            self._release(request_id)

    # --- pinning ----------------------------------------------------------------------------------------
    def pin(self, request_id: int) -> list[int]:
        """Hold the request's blocks for an outgoing transfer; returns its block ids.

        Pins nest: each pin needs one unpin. A freed request cannot be pinned.
        """
        s = self._get(request_id)
        s.pins += 1
        return list(s.blocks)

    def unpin(self, request_id: int) -> None:
        """Drop one pin; the last unpin of a freed request returns its blocks to the free list."""
        s = self._seqs.get(request_id)
        if s is None or s.pins == 0:
            raise KVCacheError(f"unpin of request {request_id} on rank {self.rank}, which is not pinned")
        s.pins -= 1
        if s.pins == 0 and s.freed:
            self._release(request_id)

    def pins(self, request_id: int) -> int:
        s = self._seqs.get(request_id)
        if s is None:
            raise KVCacheError(f"unknown request {request_id} on rank {self.rank}")
        return s.pins

    # --- internals --------------------------------------------------------------------------------------
    def _get(self, request_id: int) -> _Seq:
        s = self._seqs.get(request_id)
        if s is None or s.freed:
            what = "already freed" if s is not None else "unknown"
            raise KVCacheError(f"request {request_id} is {what} on rank {self.rank}")
        return s

    def _release(self, request_id: int) -> None:
        s = self._seqs.pop(request_id)
        self._free.extend(s.blocks)
        s.blocks = []
