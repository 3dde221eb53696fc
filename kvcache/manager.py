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

Block reuse (`enable_block_reuse=True`, prefix_tree.py): a request's FULL blocks whose tokens are known are
registered in a prefix tree once their KV is written (`update_resources` with the step's tokens,
`mark_ready`); `free_resources` then keeps them cached instead of recycling them, and they are evicted LRU
only when an allocation finds the free list empty. `match_prefix` (read-only) finds the longest cached prefix
of a prompt and `add_sequence_reusing` starts a request on those blocks (shared, reference counted). A block
held by any live request (pinned, in flight, awaiting KV) is never evicted; `get_num_free_blocks` counts the
evictable cached blocks as free. Without reuse nothing is cached and every block is recycled at once.

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
from .prefix_tree import PrefixTree

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
    tokens: list[int] | None = field(default_factory=list)  # token ids known (None: unknown, never cached)
    keys: list[bytes] = field(default_factory=list)          # chain keys of its first len(keys) full blocks


class KVCacheManager:
    """Block allocator and pool of one rank.

    Args:
        layout: the executor's KV layout (order must be "block_major").
        rank: this rank's global id (pp_rank * tp + tp_rank).
        num_blocks: blocks in the pool.
        device: where the pool lives ("cpu", "cuda:0", ...).
        max_blocks_per_seq: refuse a single request needing more blocks than this (default: num_blocks).
        enable_block_reuse: keep finished requests' full blocks cached for reuse (default off here; the
            executor turns it on from its config).
        model_id: names the weights; with the layout it makes the fingerprint of the cached blocks' keys.
    """

    def __init__(self, layout: KVLayout, rank: int, num_blocks: int, *, device: str | torch.device = "cpu",
                 max_blocks_per_seq: int | None = None, enable_block_reuse: bool = False,
                 model_id: str = "") -> None:
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
        self.fingerprint = f"{layout.fingerprint()}:{model_id}"
        self._tree = PrefixTree(self.num_blocks, self.tokens_per_block, self.fingerprint) \
            if enable_block_reuse else None
        self.reused_tokens = 0  # prompt tokens served from cached blocks (add_sequence_reusing), ever

    # --- queries ------------------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-int(num_tokens) // self.tokens_per_block)

    def get_max_resource_count(self) -> int:
        """Total blocks in the pool."""
        return self.num_blocks

    def get_num_free_blocks(self) -> int:
        """Blocks on the free list plus cached blocks no request holds (pinned blocks of freed requests are
        not free yet)."""
        return len(self._free) + (self._tree.num_evictable if self._tree is not None else 0)

    @property
    def block_reuse(self) -> bool:
        return self._tree is not None

    @property
    def prefix_tree(self) -> PrefixTree | None:
        """The prefix tree of cached blocks (None without block reuse): kv_publisher.py listens to it."""
        return self._tree

    def get_num_cached_blocks(self) -> int:
        """Blocks registered for reuse (held by requests or evictable); 0 without block reuse."""
        return self._tree.num_cached if self._tree is not None else 0

    def match_prefix(self, tokens: list[int], max_tokens: int | None = None) -> int:
        """Read-only: how many leading tokens of `tokens` (a multiple of tokens_per_block, at most
        `max_tokens`) are cached in full blocks. 0 without block reuse."""
        if self._tree is None:
            return 0
        limit = len(tokens) if max_tokens is None else min(len(tokens), int(max_tokens))
        return len(self._tree.match(tokens, limit // self.tokens_per_block)) * self.tokens_per_block

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
        free = self.get_num_free_blocks()
        if want > free:
            raise KVCacheExhausted(f"{want} more blocks needed for requests {[r for r, _ in needs]}, "
                                   f"only {free} of {self.num_blocks} free; request refused")
        for rid, n in needs:
            s = self._seqs.get(rid)
            if s is None:
                s = self._seqs[rid] = _Seq(blocks=[])
            for _ in range(self.blocks_for(n) - len(s.blocks)):
                s.blocks.append(self._take())

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

    def add_sequence_reusing(self, request_id: int, tokens: list[int], num_reused: int) -> list[int]:
        """A new request whose first `num_reused` tokens are served from cached blocks; returns their ids.

        `num_reused` must be what `match_prefix` just returned (a multiple of tokens_per_block); the request
        then holds those blocks (shared with others, never evicted while held) and `num_reused` tokens, and
        knows `tokens` (its prompt) so its own full blocks are registered as they are written.
        Raises:
            KVCacheError: the id is in use, reuse is off, or the cache no longer holds that prefix.
        """
        if request_id in self._seqs:
            raise KVCacheError(f"request {request_id} already has blocks on rank {self.rank}")
        tpb = self.tokens_per_block
        if num_reused and (self._tree is None or num_reused % tpb or num_reused > len(tokens)):
            raise KVCacheError(f"request {request_id}: cannot reuse {num_reused} tokens (reuse "
                               f"{'on' if self._tree else 'off'}, {tpb} tokens/block, prompt {len(tokens)})")
        hit = self._tree.match(tokens, num_reused // tpb) if num_reused else []
        if len(hit) * tpb != num_reused:
            raise KVCacheError(f"request {request_id}: {num_reused} tokens to reuse on rank {self.rank}, but "
                               f"only {len(hit) * tpb} are cached: allocators diverged")
        for b in hit:
            self._tree.hold(b)
        s = self._seqs[request_id] = _Seq(blocks=list(hit), num_tokens=num_reused,
                                          tokens=[int(t) for t in tokens])
        self._key_blocks(s, len(hit))
        self.reused_tokens += num_reused
        return list(hit)

    def add_sequence_for_transfer(self, request_id: int, prompt_len: int, tokens: list[int] | None = None,
                                  num_reused: int = 0) -> list[int]:
        """Generation-only: blocks for a prompt whose KV will be written by a transfer; returns block ids.

        The request stays AWAITING_KV (the engine must not decode it) until `mark_ready`. With `tokens` (the
        prompt) its full blocks are registered for reuse at `mark_ready`. With `num_reused`, the request was
        started by `add_sequence_reusing(request_id, tokens, num_reused)` (its first blocks are cached ones)
        and is grown here: only the blocks after them await KV.
        """
        if num_reused:
            s = self._get(request_id)
            if s.num_tokens != num_reused or s.state != SeqState.ACTIVE:
                raise KVCacheError(f"request {request_id} holds {s.num_tokens} tokens ({s.state}), not the "
                                   f"{num_reused} reused ones a transfer allocation expects")
            self.prepare_resources([(request_id, max(1, prompt_len))])
        else:
            self.add_sequence(request_id, prompt_len)
        s = self._seqs[request_id]
        s.state = SeqState.AWAITING_KV
        s.num_tokens = int(prompt_len)
        s.tokens = [int(t) for t in tokens] if tokens is not None else None
        return list(s.blocks)

    def mark_ready(self, request_id: int) -> None:
        """The prompt KV of a generation-only request has arrived; it may decode now."""
        s = self._get(request_id)
        if s.state != SeqState.AWAITING_KV:
            raise KVCacheError(f"request {request_id} is {s.state}, not awaiting KV; cannot mark it ready")
        s.state = SeqState.ACTIVE
        self._register_full(s)

    def add_padding_request(self, request_id: int, num_tokens: int = 1) -> list[int]:
        """A dummy request that pads a batch (e.g. to a CUDA-graph size); free it like any other."""
        blocks = self.add_sequence(request_id, num_tokens)
        self._seqs[request_id].state = SeqState.PADDING
        return blocks

    def update_resources(self, done: Iterable[tuple[int, int]],
                         tokens: dict[int, list[int]] | None = None) -> None:
        """After a step: each (request_id, num_tokens) now holds num_tokens tokens of KV in its blocks.

        Args:
            done: (request_id, num_tokens) per request of the step.
            tokens: request_id -> the token ids the step fed it (its last ones); with block reuse, blocks
                that are now full and whose tokens are all known are registered in the prefix tree.
        """
        for rid, n in done:
            s = self._get(rid)
            if self.blocks_for(n) > len(s.blocks):
                raise KVCacheError(f"request {rid} holds {len(s.blocks)} blocks, too few for {n} tokens")
            s.num_tokens = int(n)
            new = (tokens or {}).get(rid)
            if new is not None and s.tokens is not None:
                start = int(n) - len(new)
                if len(s.tokens) == start:
                    s.tokens.extend(int(t) for t in new)
                elif len(s.tokens) < int(n):
                    s.tokens = None  # a gap: this request's later blocks cannot be keyed
            if s.state == SeqState.ACTIVE:
                self._register_full(s)

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
        if self._tree is None:
            self._free.extend(s.blocks)
        else:  # the last block goes first into the LRU, so a prefix's leaves are evicted before its root
            freed = [b for b in reversed(s.blocks) if self._tree.drop(b)]
            self._free.extend(reversed(freed))
        s.blocks = []

    def _take(self) -> int:
        """One block for a request: from the free list, else the LRU evictable cached block."""
        if self._free:
            b = self._free.popleft()
        else:
            b = self._tree.evict_one() if self._tree is not None else None
            if b is None:  # prepare_resources counted first: this is a bug, not exhaustion
                raise KVCacheError(f"rank {self.rank}: no free or evictable block left")
        if self._tree is not None:
            self._tree.hold(b)
        return b

    def _key_blocks(self, s: _Seq, upto: int) -> None:
        """Extend `s.keys` to its first `upto` full blocks (their tokens must be known)."""
        tpb, tree = self.tokens_per_block, self._tree
        while len(s.keys) < upto:
            i = len(s.keys)
            parent = s.keys[-1] if s.keys else tree.root
            s.keys.append(tree.register(s.blocks[i], parent, s.tokens[i * tpb:(i + 1) * tpb]))

    def _register_full(self, s: _Seq) -> None:
        """Register the request's full, written blocks whose tokens are known (block reuse only)."""
        if self._tree is None or s.tokens is None or s.state == SeqState.PADDING:
            return
        self._key_blocks(s, min(s.num_tokens, len(s.tokens)) // self.tokens_per_block)
