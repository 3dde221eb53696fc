"""The Executor's public value types: its configuration and what its calls return.

Plain frozen data (ExecutorConfig is mutable only while it is being built); runtime.py re-exports all four,
so `from kvbridge.executor.runtime import ExecutorConfig` keeps working.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..transceiver.stats import TransferStats
from .connector.base import KvConnectorConfig
from .sampling import TokenLogprob

__all__ = ["ExecutorConfig", "ContextResult", "GenerationHandle", "Completion"]


@dataclass
class ExecutorConfig:
    """How to run an executor.

    Attributes:
        model: a model spec (see sources.describe_models()).
        tp, pp, layers_per_stage: the split (rank = pp_rank * tp + tp_rank).
        num_blocks, tokens_per_block: every rank's pool.
        device: "cpu", "cuda" (rank r on cuda:r % device_count) or "cuda:N" (rank r on cuda:(N + r) % count).
        dtype: pool and weight dtype; default float32 on CPU, bfloat16 on CUDA.
        timeout_s: bound on start-up, every collective and every wait of this handle.
        threads_per_rank: torch intra-op threads per rank process.
        rank_hook, rank_hook_args: "module:factory" built in every rank process (the transceiver): hooks.py.
        kv_digests: every rank records a positional digest of each context-only request's KV when its
            prefill is done and of each generation-only request's KV when it is ready (`kv_digest`).
        kv_connector_config: a KV cache connector (connector/base.py), e.g.
            KvConnectorConfig.persistent("/data/kv", max_bytes=8 << 30): prompts' KV saved to and loaded
            from a folder shared across executors and restarts.
        enable_block_reuse: keep finished requests' full KV blocks cached and start requests whose prompt
            prefix is cached on those blocks (kvcache/manager.py); serving turns it on by default.
        stream_layers: layer-wise streaming (streaming.py; needs a rank hook that streams, the transceiver's):
            0 = off, a context-only request is published once its prefill is done; N > 0 = it is published
            when its blocks are allocated and every rank marks its local layers ready every N layers as the
            prefill's forward pass writes them, so the generation side reads layer L while L+1 computes.
        kv_events: publish the prefix cache's KV events from rank 0 (kv_publisher.py; needs block reuse):
            {"secret": hex key (kv_events.derive_secret), "incarnation": str, "host": bind address,
            "endpoint_file": where the bound endpoints are written}; None = off.
    """

    model: str = "seeded:tiny"
    tp: int = 1
    pp: int = 1
    layers_per_stage: tuple[int, ...] | None = None
    num_blocks: int = 256
    tokens_per_block: int = 16
    device: str = "cpu"
    dtype: str | None = None
    max_batch_tokens: int = 2048
    max_batch_seqs: int = 64
    timeout_s: float = 120.0
    threads_per_rank: int = 1
    rank_hook: str | None = None
    rank_hook_args: dict = field(default_factory=dict)
    kv_connector_config: KvConnectorConfig | dict | None = None
    kv_digests: bool = False
    enable_block_reuse: bool = False
    stream_layers: int = 0
    kv_events: dict | None = None

    def resolved_dtype(self) -> str:
        return self.dtype or ("bfloat16" if self.device.startswith("cuda") else "float32")


@dataclass(frozen=True)
class ContextResult:
    """A finished context-only prefill: its KV is in `block_ids` of every rank, pinned until release."""

    request_id: int
    block_ids: tuple[int, ...]
    num_tokens: int
    first_token: int
    reused_tokens: int = 0  # leading prompt tokens served from the prefix cache (not computed)
    first_logprob: TokenLogprob | None = None  # when the sampling params asked for logprobs
    prefill_end: float = 0.0  # unix seconds: the prefill's step ended (its forward and sampling)


@dataclass(frozen=True)
class GenerationHandle:
    """A generation-only request waiting for its prompt KV in `block_ids` (same ids on every rank)."""

    request_id: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class Completion:
    request_id: int
    tokens: list[int]
    finish_reason: str
    error: str = ""  # why an aborted request was aborted (e.g. the KV transfer's error), when known
    transfer: TransferStats | None = None  # generation-only: the KV transfer's stats (rank 0's pull)
    loaded_tokens: int = 0  # prompt tokens whose KV the KV connector loaded instead of computing them
    reused_tokens: int = 0  # prompt tokens served from this executor's prefix cache (block reuse)
    logprobs: tuple[TokenLogprob, ...] = ()  # of each token sampled by this executor, when asked for
    decode_at: float = 0.0  # generation-only: unix seconds when it started decoding (KV and first token in)
