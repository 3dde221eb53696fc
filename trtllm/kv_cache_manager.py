"""TensorRT-LLM's KVCacheManager constructor and scheduled-batch methods over kvbridge's own manager.

Owns the translation only: `KvCacheConfig`, `CacheType` and `Mapping` (upstream names) into a KVLayout and a
pool size, and scheduled batches of LlmRequests into the (request id, token count) lists of
`kvcache/manager.py`, which it wraps (`impl`) and never changes. Never runs the model and never
moves KV; a refused call (pool exhausted, unknown request) leaves the manager as it was.

    prepare_resources(scheduled_batch)   context requests get blocks for their prompt; DISAGG_GENERATION_INIT
                                         ones get blocks the transfer will fill; generation requests grow by
                                         their newest token. All or nothing.
    update_resources(scheduled_batch)    after the step: every scheduled request holds the KV of all its
                                         tokens but the last sampled one.
    free_resources(request)              the request's blocks go back (or at the last pin of a transfer).
    get_needed_resource_to_completion(request)  blocks still to allocate for prompt + max_new_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterable

import torch

from ..errors import KVCacheError
from ..formatter.layout import KVLayout, KVShape, ParallelSplit
from ..kvcache.manager import TORCH_DTYPES
from ..kvcache.manager import KVCacheManager as _Impl
from .llm_request import LlmRequest, LlmRequestState

__all__ = ["CacheType", "KVCacheManager", "KvCacheConfig", "Mapping", "ScheduledRequests"]

_KV_CACHE_KEYS = {"max_tokens", "free_gpu_memory_fraction", "enable_block_reuse", "dtype", "tokens_per_block",
                  "enable_partial_reuse", "copy_on_partial_reuse", "onboard_blocks"}


class CacheType(Enum):
    """Upstream CacheType; kvbridge keeps SELF (decoder self-attention) caches only."""

    SELF = 0
    CROSS = 1
    SELFKONLY = 2


@dataclass(frozen=True)
class KvCacheConfig:
    """The upstream `kv_cache_config` fields kvbridge reads.

    max_tokens: pool size in tokens (None: max_batch_size x max_seq_len). free_gpu_memory_fraction,
    enable_block_reuse, enable_partial_reuse, copy_on_partial_reuse, onboard_blocks: accepted, no effect
    (kvbridge sizes pools by tokens and reuses prefixes through a KV connector). dtype: "auto" or a dtype
    name for the KV. tokens_per_block: block size where no constructor argument gives it.
    """

    max_tokens: int | None = None
    free_gpu_memory_fraction: float | None = None
    enable_block_reuse: bool = True
    dtype: str = "auto"
    tokens_per_block: int = 32
    enable_partial_reuse: bool = True
    copy_on_partial_reuse: bool = True
    onboard_blocks: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens is not None and (type(self.max_tokens) is not int or self.max_tokens < 1):
            raise KVCacheError(f"kv_cache_config.max_tokens: expected a positive integer, got "
                               f"{self.max_tokens!r}")
        if type(self.tokens_per_block) is not int or self.tokens_per_block < 1:
            raise KVCacheError(f"kv_cache_config.tokens_per_block: expected a positive integer, got "
                               f"{self.tokens_per_block!r}")
        if self.dtype != "auto" and self.dtype not in TORCH_DTYPES:
            raise KVCacheError(f"kv_cache_config.dtype: {self.dtype!r} is not auto or one of "
                               f"{sorted(TORCH_DTYPES)}")

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "KvCacheConfig":
        d = dict(d or {})
        bad = sorted(set(d) - _KV_CACHE_KEYS)
        if bad:
            raise KVCacheError(f"kv_cache_config.{bad[0]}: unknown key (kvbridge maps "
                               f"{sorted(_KV_CACHE_KEYS)})")
        return cls(**d)


@dataclass(frozen=True)
class Mapping:
    """Upstream Mapping's parallel sizes; rank = pp_rank * tp_size + tp_rank (as kvbridge's layouts)."""

    world_size: int = 1
    rank: int = 0
    tp_size: int = 1
    pp_size: int = 1

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.pp_size < 1 or self.world_size != self.tp_size * self.pp_size:
            raise KVCacheError(f"mapping: world_size {self.world_size} must equal tp_size {self.tp_size} x "
                               f"pp_size {self.pp_size}")
        if not 0 <= self.rank < self.world_size:
            raise KVCacheError(f"mapping: rank {self.rank} outside 0..{self.world_size - 1}")

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size


@dataclass
class ScheduledRequests:
    """One step's batch (upstream names): requests in their context phase, and decoding ones."""

    context_requests: list[LlmRequest] = field(default_factory=list)
    generation_requests: list[LlmRequest] = field(default_factory=list)

    @property
    def all_requests(self) -> list[LlmRequest]:
        return self.context_requests + self.generation_requests


def _dtype_name(dtype: Any, kv_dtype: str) -> str:
    if kv_dtype != "auto":
        return kv_dtype
    if isinstance(dtype, torch.dtype):
        for name, t in TORCH_DTYPES.items():
            if t == dtype:
                return name
    if isinstance(dtype, str) and dtype in TORCH_DTYPES:
        return dtype
    raise KVCacheError(f"dtype: {dtype!r} is not a torch dtype or one of {sorted(TORCH_DTYPES)}")


class KVCacheManager:
    """Upstream's constructor; `impl` is kvbridge's manager (the model and transceiver use its pool)."""

    def __init__(self, kv_cache_config: KvCacheConfig, kv_cache_type: CacheType, *, num_layers: int,
                 num_kv_heads: int, head_dim: int, tokens_per_block: int, max_seq_len: int,
                 max_batch_size: int, mapping: Mapping, dtype: Any = torch.float32,
                 device: str | torch.device = "cpu") -> None:
        if kv_cache_type is not CacheType.SELF:
            raise KVCacheError(f"kv_cache_type: {kv_cache_type} is not supported (kvbridge keeps SELF "
                               f"caches)")
        if max_seq_len < 1 or max_batch_size < 1:
            raise KVCacheError(f"max_seq_len ({max_seq_len}) and max_batch_size ({max_batch_size}) must be "
                               f">= 1")
        shape = KVShape(num_layers, num_kv_heads, head_dim, _dtype_name(dtype, kv_cache_config.dtype),
                        tokens_per_block)
        self.mapping = mapping
        self.layout = KVLayout(shape, ParallelSplit(mapping.tp_size, mapping.pp_size), "block_major")
        per_seq = -(-max_seq_len // tokens_per_block)
        tokens = kv_cache_config.max_tokens
        num_blocks = -(-tokens // tokens_per_block) if tokens else per_seq * max_batch_size
        self.max_seq_len, self.max_batch_size = max_seq_len, max_batch_size
        self.impl = _Impl(self.layout, mapping.rank, num_blocks, device=device, max_blocks_per_seq=per_seq)

    # --- upstream's names -----------------------------------------------------------------------------
    @property
    def tokens_per_block(self) -> int:
        return self.impl.tokens_per_block

    @property
    def pool(self) -> torch.Tensor:
        return self.impl.pool

    def prepare_resources(self, scheduled_batch: ScheduledRequests) -> None:
        """Blocks for this step's requests (see the module docstring); all or nothing."""
        gen_init = [r for r in scheduled_batch.context_requests
                    if r.state is LlmRequestState.DISAGG_GENERATION_INIT and r.request_id not in self.impl]
        needs = [(r.request_id, r.prompt_len) for r in scheduled_batch.context_requests if r not in gen_init]
        needs += [(r.request_id, r.get_num_tokens()) for r in scheduled_batch.generation_requests]
        want = sum(self.impl.get_needed_resource_to_completion(r.prompt_len) for r in gen_init)
        if want > self.impl.get_num_free_blocks():
            raise KVCacheError(f"{want} blocks needed for {len(gen_init)} generation-only requests, only "
                               f"{self.impl.get_num_free_blocks()} free; nothing allocated")
        self.impl.prepare_resources(needs)  # refuses (allocating nothing) when the pool is short
        for r in gen_init:  # cannot run short now: counted above, and nothing else allocated in between
            self.impl.add_sequence_for_transfer(r.request_id, r.prompt_len)

    def update_resources(self, scheduled_batch: ScheduledRequests) -> None:
        """After the step: each request's cache holds every token but its last sampled one."""
        done = [(r.request_id, max(r.prompt_len, r.get_num_tokens() - 1))
                for r in scheduled_batch.all_requests
                if r.request_id in self.impl and self.impl.state(r.request_id) == "active"]
        self.impl.update_resources(done)

    def free_resources(self, request: LlmRequest) -> None:
        self.impl.free_resources(request.request_id)

    def get_needed_resource_to_completion(self, request: LlmRequest) -> int:
        rid = request.request_id if request.request_id in self.impl else None
        return self.impl.get_needed_resource_to_completion(request.prompt_len + request.max_new_tokens, rid)

    def get_cache_indices(self, request: LlmRequest) -> list[int]:
        return self.impl.get_batch_cache_indices([request.request_id])[0]

    def get_batch_cache_indices(self, request_ids: Iterable[int]) -> list[list[int]]:
        return self.impl.get_batch_cache_indices(request_ids)

    def get_buffers(self, layer_idx: int) -> torch.Tensor:
        return self.impl.get_buffers(layer_idx)

    def get_num_free_blocks(self) -> int:
        return self.impl.get_num_free_blocks()

    def get_max_resource_count(self) -> int:
        return self.impl.get_max_resource_count()

    def shutdown(self) -> None:
        """Nothing to release beyond the pool tensor (kept for upstream's call sequence)."""
