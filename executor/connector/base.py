"""The KV cache connector contract: TensorRT-LLM's scheduler/worker roles and hook names, for kvbridge's executor.

A connector moves KV blocks between the executor's pool and somewhere else (a folder, an object store,
another instance) so a request can skip computing KV that exists already. It has two halves:

    KvConnectorScheduler  ONE instance, in the leader rank process (rank 0), beside the engine. Decides.
    KvConnectorWorker     one instance in EVERY rank process, over that rank's pool. Moves bytes.

Build one with `ExecutorConfig(kv_connector_config=KvConnectorConfig("pkg.mod", "MySched", "MyWorker", args))`:
both classes are imported from the module and built with a `ConnectorContext`.

Scheduler side (leader process, the engine's thread, between steps; never touches tensors, never blocks on I/O
for long, never frees blocks):

    get_num_new_matched_tokens(request, num_computed_tokens) -> (num_tokens, load_async)   REQUIRED
        when the engine admits an aggregated or context-only request (not generation-only): how many prompt
        tokens after `num_computed_tokens` the connector can load. The engine keeps at least one prompt token
        to compute (it needs its logits) and only loads whole blocks: an answer that is not a multiple of
        tokens_per_block, or reaches the prompt's end, is refused (logged) and the request is computed.
        Should not change what a later call answers (the engine may not admit the request after all).
    update_state_after_alloc(request, block_ids)                                           optional
        after the engine allocated blocks for a request with matched tokens: block_ids are the request's
        blocks (the same ids on every rank), in token order. Called at the start of the NEXT plan (kvbridge
        allocates inside a step; TensorRT-LLM within the same one).
    build_connector_meta(scheduler_output) -> ConnectorMetadata | None                     REQUIRED
        once per step plan: what the workers should load and save in this step. The result travels to every
        rank inside the step plan as msgpack (`to_wire`, decoded by the worker's `metadata_cls.from_wire`):
        plain data only, never pickle.
    request_finished(request, cache_block_ids) -> bool                                     optional (False)
        an aggregated or generation-only request finished, or a context-only one was released (its KV is
        complete: request.num_computed_tokens tokens of it are in cache_block_ids). True: the connector saves
        asynchronously and the engine keeps the blocks until every rank's `get_finished` reported the request
        as saved; then it frees them. Not called for aborted requests.
    close()                                                                                optional

Worker side (every rank process, its main thread, in lockstep with the step; must return quickly):

    register_kv_caches(kv_cache_tensor)                                                    REQUIRED
        once at start: the rank's pool, block_major [num_blocks, local_layers, kv_factor, local_kv_heads,
        tokens_per_block, head_dim], contiguous (a block is one contiguous range of the tensor).
    bind_connector_meta(metadata)                                                          provided
        before start_load_kv: the metadata the scheduler built for this step (None when it built none).
    start_load_kv(stream)                                                                  REQUIRED
        after the step's allocation ops, before its forward: begin the loads (and saves) the metadata names.
    wait_for_layer_load(layer_idx, stream)                                                 optional
        before local layer `layer_idx` of the forward (for layer-wise loading).
    save_kv_layer(layer_idx, stream)                                                       optional
        after local layer `layer_idx` of the forward has written its KV.
    wait_for_save(stream)                                                                  REQUIRED
        after the forward: block until the step's SYNCHRONOUS saves are done (asynchronous ones go on).
    get_finished(finished_gen_req_ids, started_loading_req_ids) -> (saved ids, loaded ids) REQUIRED
        after every step, also idle ones: requests whose asynchronous save or load ended on THIS rank. An id
        may be returned only after it was passed in (saving: request_finished said True; loading:
        get_num_new_matched_tokens said load_async), and once. The engine acts on an id when EVERY rank
        returned it: it frees a saved request's blocks, and starts a loaded request's prefill.
    get_load_errors() -> {request_id: reason}                                              optional ({})
        loads that ended in failure on this rank (reported with, or before, their id in get_finished). If any
        rank failed, the engine computes the request's whole prompt instead (after every rank's load ended,
        so no late write lands in a block being computed).
    close()                                                                                optional

`stream` is the rank's current CUDA stream, or None on CPU. A worker never frees, pins or allocates blocks;
it moves bytes into or out of the block ids it was given, only while the engine holds them for it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ...formatter.layout import KVLayout

__all__ = [
    "ConnectorContext",
    "ConnectorMetadata",
    "ConnectorRequest",
    "KvConnectorConfig",
    "KvConnectorScheduler",
    "KvConnectorWorker",
    "RequestData",
    "SchedulerOutput",
]


@dataclass(frozen=True)
class KvConnectorConfig:
    """Which connector an executor runs (TensorRT-LLM's KvCacheConnectorConfig, plus the connector's args).

    Attributes:
        connector_module: import path of the module holding both classes.
        connector_scheduler_class: the KvConnectorScheduler subclass's name in it.
        connector_worker_class: the KvConnectorWorker subclass's name in it.
        args: plain values (msgpack-able) for both halves, e.g. {"root": "/data/kv", "max_bytes": 1 << 30}.
    """

    connector_module: str
    connector_scheduler_class: str
    connector_worker_class: str
    args: dict = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {"module": self.connector_module, "scheduler": self.connector_scheduler_class,
                "worker": self.connector_worker_class, "args": dict(self.args)}

    @classmethod
    def persistent(cls, root: str, max_bytes: int = 0, **args: Any) -> KvConnectorConfig:
        """kvbridge's persistent store connector over `root` (max_bytes 0: no bound)."""
        return cls("kvbridge.executor.connector.persistent", "PersistentKvConnectorScheduler",
                   "PersistentKvConnectorWorker", {"root": str(root), "max_bytes": int(max_bytes), **args})


@dataclass(frozen=True)
class ConnectorContext:
    """What both halves are built with.

    Attributes:
        rank: this rank (the scheduler gets 0).
        world_size: ranks of the executor (each holds its own shard of every block).
        tokens_per_block: tokens per KV block.
        namespace: 32 hex digits naming the model and layout (keys and folders of stored KV include it).
        model: the model spec the executor runs.
        device: the rank's device (the scheduler gets the leader's).
        num_blocks: blocks in every rank's pool.
        args: the connector's own arguments (KvConnectorConfig.args).
        layout: the executor's KV layout (None under another engine, e.g. TensorRT-LLM).
    """

    rank: int
    world_size: int
    tokens_per_block: int
    namespace: str
    model: str
    device: torch.device
    num_blocks: int
    args: dict = field(default_factory=dict)
    layout: KVLayout | None = None


@dataclass(frozen=True)
class ConnectorRequest:
    """The scheduler's read-only view of a request.

    Attributes:
        request_id: the executor's id.
        tokens: prompt then generated tokens.
        prompt_len: how many of `tokens` are the prompt.
        num_computed_tokens: tokens whose KV is in the request's blocks.
        mode: "aggregated" or "context_only".
    """

    request_id: int
    tokens: tuple[int, ...]
    prompt_len: int
    num_computed_tokens: int
    mode: str = "aggregated"

    def get_tokens(self, beam: int = 0) -> list[int]:
        """TensorRT-LLM's LlmRequest spelling of `tokens`."""
        return list(self.tokens)


@dataclass
class RequestData:
    """One scheduled request in a SchedulerOutput (TensorRT-LLM's field names).

    new_block_ids are the blocks the request gained since it was last reported, as allocated when the plan
    is built: kvbridge allocates a step's blocks inside the step, so they show up one step later.
    """

    request_id: int
    new_tokens: list[int]
    new_block_ids: list[int]
    computed_position: int
    num_scheduled_tokens: int


@dataclass
class SchedulerOutput:
    """The step's scheduled requests: first time scheduled (new_requests) or again (cached_requests)."""

    new_requests: list[RequestData] = field(default_factory=list)
    cached_requests: list[RequestData] = field(default_factory=list)


class ConnectorMetadata(ABC):
    """What a scheduler sends its workers for one step; crosses process boundaries as plain msgpack data."""

    @abstractmethod
    def to_wire(self) -> Any:
        """Plain data (dict/list/str/bytes/int/float/bool/None)."""

    @classmethod
    @abstractmethod
    def from_wire(cls, data: Any) -> ConnectorMetadata:
        """Decode and validate `to_wire`'s output; raise ProtocolError naming the bad field."""


class KvConnectorScheduler(ABC):
    """Scheduler (leader) half; see the module docstring for when each hook is called."""

    def __init__(self, ctx: ConnectorContext) -> None:
        self.ctx = ctx

    @abstractmethod
    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens after `num_computed_tokens` the connector can load, and whether it loads them asynchronously.

        Args:
            request: the request being admitted.
            num_computed_tokens: tokens already in the request's blocks (0 in kvbridge's executor).
        Returns:
            (number of tokens, load asynchronously).
        """

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: list[int]) -> None:
        """The request's blocks (in token order) after allocation, when it had matched tokens."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMetadata | None:
        """This step's work for the workers (None: nothing)."""

    def request_finished(self, request: ConnectorRequest, cache_block_ids: list[int]) -> bool:
        """A request finished; True keeps its blocks until every worker reported it saved.

        Args:
            request: the finished request (num_computed_tokens tells how many tokens have KV).
            cache_block_ids: its blocks, in token order.
        Returns:
            Whether the connector saves asynchronously (the engine defers the free).
        """
        return False

    def close(self) -> None:
        """The executor stops."""


class KvConnectorWorker(ABC):
    """Worker (per rank) half; see the module docstring for when each hook is called.

    Class attributes:
        metadata_cls: the ConnectorMetadata subclass the scheduler builds (decodes the wire form).
    """

    metadata_cls: ClassVar[type[ConnectorMetadata] | None] = None

    def __init__(self, ctx: ConnectorContext) -> None:
        self.ctx = ctx
        self._metadata: ConnectorMetadata | None = None

    def bind_connector_meta(self, metadata: ConnectorMetadata | None) -> None:
        self._metadata = metadata

    def get_connector_meta(self) -> ConnectorMetadata | None:
        return self._metadata

    def _clear_connector_meta(self) -> None:
        self._metadata = None

    @abstractmethod
    def register_kv_caches(self, kv_cache_tensor: torch.Tensor) -> None:
        """The rank's pool tensor (contiguous, blocks along dim 0)."""

    @abstractmethod
    def start_load_kv(self, stream: Any = None) -> None:
        """Begin this step's loads (and saves) named by the bound metadata."""

    def wait_for_layer_load(self, layer_idx: int, stream: Any = None) -> None:
        """Before local layer `layer_idx` runs."""

    def save_kv_layer(self, layer_idx: int, stream: Any = None) -> None:
        """After local layer `layer_idx` wrote its KV."""

    @abstractmethod
    def wait_for_save(self, stream: Any = None) -> None:
        """After the forward: finish the step's synchronous saves."""

    @abstractmethod
    def get_finished(self, finished_gen_req_ids: list[int],
                     started_loading_req_ids: list[int]) -> tuple[list[int], list[int]]:
        """Requests whose asynchronous save / load ended on this rank.

        Args:
            finished_gen_req_ids: requests that started saving since the last call.
            started_loading_req_ids: requests that started loading since the last call.
        Returns:
            (ids whose save ended, ids whose load ended), each id once, only after it was passed in.
        """

    def get_load_errors(self) -> dict[int, str]:
        """Loads that failed on this rank since the last call: {request_id: reason}."""
        return {}

    def close(self) -> None:
        """The executor stops: end or abandon in-flight work within a bounded time."""
