"""TensorRT-LLM's KV Cache Connector base classes (built from `llm_args`), run on kvbridge's executor.

A connector written against TensorRT-LLM (`KvCacheConnectorScheduler(llm_args)`, `KvCacheConnectorWorker(
llm_args)`, the hooks of executor/connector/base.py with upstream's names and arguments) runs unchanged in
kvbridge's executor through two adapters, which the executor config names:

    ExecutorConfig(kv_connector_config=kv_connector_config("my.module", "MyScheduler", "MyWorker", root=...))

Owns: the upstream base classes, the `LlmArgs` view built from the executor config (model, parallel sizes,
kv_cache_config.tokens_per_block, the connector's args), `mpi_rank()`, the adapters, and carrying
`build_connector_meta`'s result to the ranks. That result may be any plain data (None, bool, int, float, str,
bytes, lists, tuples, dicts) or dataclasses of the connector's own module or this one, nested; it
crosses processes as msgpack and is rebuilt on every rank (tuples arrive as lists). Anything else is refused
with the type's name: nothing is pickled. `scheduler_output` is upstream's SchedulerOutput: new_requests carry
every token reported so far (a loaded prefix included), as upstream does.
Never allocates or frees blocks (the engine does) and never reads the pool outside the worker hooks.
"""

from __future__ import annotations

import dataclasses
import importlib
from abc import ABC, abstractmethod
from typing import Any, Callable

import torch

from ...errors import ExecutorError, ProtocolError
from ...trtllm.kv_cache_manager import KvCacheConfig
from .base import (ConnectorContext, ConnectorMetadata, KvConnectorConfig,
                                       KvConnectorScheduler, KvConnectorWorker, RequestData, SchedulerOutput)

__all__ = ["KvCacheConnectorScheduler", "KvCacheConnectorWorker", "LlmArgs", "RequestData", "SchedulerOutput",
           "TrtllmSchedulerAdapter", "TrtllmWorkerAdapter", "decode_meta", "encode_meta",
           "kv_connector_config", "mpi_rank"]

_TAG = "__kvbridge_dataclass__"
_MAX_DEPTH = 32
_RANK = [0]


def mpi_rank() -> int:
    """This process's rank (upstream's tensorrt_llm._utils.mpi_rank), set before the worker is built."""
    return _RANK[0]


@dataclasses.dataclass(frozen=True)
class LlmArgs:
    """The llm_args fields a connector reads, from kvbridge's executor config."""

    model: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    kv_cache_config: KvCacheConfig
    connector_args: dict = dataclasses.field(default_factory=dict)  # KvConnectorConfig.args (kvbridge only)
    kvbridge_namespace: str = ""  # model + layout fingerprint (kvbridge only): a store key prefix


class KvCacheConnectorScheduler(ABC):
    """Upstream's scheduler half (rank 0). See executor/connector/base.py for when each hook runs."""

    def __init__(self, llm_args: LlmArgs) -> None:
        self._llm_args = llm_args

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        """This step's work for the workers: plain data or dataclasses (see the module docstring), or None."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens the connector can load after num_computed_tokens, load asynchronously)."""

    @abstractmethod
    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        """True: the connector saves asynchronously and the blocks stay held until get_finished says so."""

    @abstractmethod
    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        """The request's blocks, after get_num_new_matched_tokens matched some tokens."""


class KvCacheConnectorWorker(ABC):
    """Upstream's worker half (every rank)."""

    def __init__(self, llm_args: LlmArgs) -> None:
        self._llm_args = llm_args
        self._metadata: Any = None

    def bind_connector_meta(self, metadata: Any) -> None:
        self._metadata = metadata

    def get_connector_meta(self) -> Any:
        return self._metadata

    def _clear_connector_meta(self) -> None:
        self._metadata = None

    def register_forward_pass_callable(self) -> Callable | None:
        """Upstream's end-of-forward callable; kvbridge calls wait_for_save there instead."""
        return None

    @abstractmethod
    def register_kv_caches(self, kv_cache_tensor: torch.Tensor) -> None: ...

    @abstractmethod
    def start_load_kv(self, stream: Any) -> None: ...

    @abstractmethod
    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None: ...

    @abstractmethod
    def save_kv_layer(self, layer_idx: int, stream: Any) -> None: ...

    @abstractmethod
    def wait_for_save(self, stream: Any) -> None: ...

    @abstractmethod
    def get_finished(self, finished_gen_req_ids: list[int],
                     started_loading_req_ids: list[int]) -> tuple[list[int], list[int]]: ...


def kv_connector_config(connector_module: str, connector_scheduler_class: str, connector_worker_class: str,
                        **args: Any) -> KvConnectorConfig:
    """ExecutorConfig.kv_connector_config for an upstream-style connector (args: plain values, llm_args)."""
    names = {"trtllm_module": connector_module, "trtllm_scheduler": connector_scheduler_class,
             "trtllm_worker": connector_worker_class}
    return KvConnectorConfig(__name__, "TrtllmSchedulerAdapter", "TrtllmWorkerAdapter", {**names, **args})


# --- metadata across processes ----------------------------------------------------------------------------
def encode_meta(obj: Any, depth: int = 0) -> Any:
    """Plain msgpack data for `obj`; ExecutorError naming what cannot be carried without pickle."""
    if depth > _MAX_DEPTH:
        raise ExecutorError(f"connector metadata nests deeper than {_MAX_DEPTH}")
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    if isinstance(obj, (list, tuple)):
        return [encode_meta(v, depth + 1) for v in obj]
    if isinstance(obj, dict):
        if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in obj) or _TAG in obj:
            raise ExecutorError("connector metadata: dict keys must be str or int")
        return {k: encode_meta(v, depth + 1) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        cls = type(obj)
        return {_TAG: f"{cls.__module__}:{cls.__qualname__}",
                "fields": {f.name: encode_meta(getattr(obj, f.name), depth + 1)
                           for f in dataclasses.fields(obj) if f.init}}
    raise ExecutorError(f"connector metadata: a {type(obj).__module__}.{type(obj).__qualname__} cannot cross "
                        f"processes without pickle; return plain data or dataclasses of the connector's "
                        f"module")


def decode_meta(data: Any, modules: frozenset[str], depth: int = 0) -> Any:
    """Rebuild encode_meta's output; dataclasses only from `modules`. ProtocolError names what was wrong."""
    if depth > _MAX_DEPTH:
        raise ProtocolError(f"connector metadata nests deeper than {_MAX_DEPTH}")
    if isinstance(data, list):
        return [decode_meta(v, modules, depth + 1) for v in data]
    if not isinstance(data, dict):
        return data
    if _TAG not in data:
        return {k: decode_meta(v, modules, depth + 1) for k, v in data.items()}
    name, fields = data.get(_TAG), data.get("fields")
    mod, _, qual = name.partition(":") if isinstance(name, str) else ("", "", "")
    if mod not in modules or not qual or not isinstance(fields, dict):
        raise ProtocolError(f"connector metadata: class {name!r:.100} is not a dataclass of "
                            f"{sorted(modules)}")
    cls: Any = importlib.import_module(mod)
    for part in qual.split("."):
        cls = getattr(cls, part, None)
    init = {f.name for f in dataclasses.fields(cls) if f.init} if dataclasses.is_dataclass(cls) else None
    if not isinstance(cls, type) or init is None or set(fields) - init:
        raise ProtocolError(f"connector metadata: {name!r:.100} is not a dataclass with fields "
                            f"{sorted(fields)}")
    return cls(**{k: decode_meta(v, modules, depth + 1) for k, v in fields.items()})


class _Meta(ConnectorMetadata):
    """The encoded metadata as kvbridge's plan carries it; decoded by the worker adapter."""

    def __init__(self, wire: Any) -> None:
        self.wire = wire

    def to_wire(self) -> Any:
        return self.wire

    @classmethod
    def from_wire(cls, data: Any) -> "_Meta":
        return cls(data)


# --- the adapters kvbridge's executor builds -----------------------------------------------------------
def _llm_args(ctx: ConnectorContext) -> LlmArgs:
    split = ctx.layout.split if ctx.layout is not None else None
    extra = {k: v for k, v in ctx.args.items() if not k.startswith("trtllm_")}
    return LlmArgs(ctx.model, split.tp if split else ctx.world_size, split.pp if split else 1,
                   KvCacheConfig(max_tokens=ctx.num_blocks * ctx.tokens_per_block or None,
                                 tokens_per_block=ctx.tokens_per_block), extra, ctx.namespace)


def _load(ctx: ConnectorContext, role: str, base: type) -> type:
    mod, name = ctx.args.get("trtllm_module"), ctx.args.get(f"trtllm_{role}")
    try:
        cls = getattr(importlib.import_module(str(mod)), str(name))
    except (ImportError, AttributeError) as e:
        raise ExecutorError(f"trtllm connector {role} {mod}:{name} cannot be loaded: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ExecutorError(f"trtllm connector {role} {mod}:{name} is not a {base.__name__} subclass")
    return cls


class TrtllmSchedulerAdapter(KvConnectorScheduler):
    """kvbridge's scheduler half over an upstream KvCacheConnectorScheduler."""

    def __init__(self, ctx: ConnectorContext) -> None:
        super().__init__(ctx)
        self.inner = _load(ctx, "scheduler", KvCacheConnectorScheduler)(_llm_args(ctx))
        self._prompts: dict[int, list[int]] = {}  # admitted, not yet in a SchedulerOutput: their prompts

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        self._prompts[request.request_id] = list(request.tokens[:request.prompt_len])
        return self.inner.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, block_ids: list[int]) -> None:
        self.inner.update_state_after_alloc(request, block_ids)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMetadata | None:
        meta = self.inner.build_connector_meta(self._upstream(scheduler_output))
        return None if meta is None else _Meta(encode_meta(meta))

    def request_finished(self, request, cache_block_ids: list[int]) -> bool:
        self._prompts.pop(request.request_id, None)
        return bool(self.inner.request_finished(request, cache_block_ids))

    def close(self) -> None:
        for hook in ("shutdown", "close"):
            if callable(getattr(self.inner, hook, None)):
                getattr(self.inner, hook)()

    def _upstream(self, out: SchedulerOutput) -> SchedulerOutput:
        """Upstream's semantics: a new request's new_tokens start at token 0 (its loaded prefix included)."""
        res = SchedulerOutput(cached_requests=list(out.cached_requests))
        for r in out.new_requests:
            head = self._prompts.pop(r.request_id, [])[:r.computed_position]
            res.new_requests.append(RequestData(r.request_id, head + list(r.new_tokens),
                                                list(r.new_block_ids), r.computed_position - len(head),
                                                r.num_scheduled_tokens))
        return res


class TrtllmWorkerAdapter(KvConnectorWorker):
    """kvbridge's worker half over an upstream KvCacheConnectorWorker."""

    metadata_cls = _Meta

    def __init__(self, ctx: ConnectorContext) -> None:
        super().__init__(ctx)
        _RANK[0] = ctx.rank
        cls = _load(ctx, "worker", KvCacheConnectorWorker)
        sched_mod = str(ctx.args.get("trtllm_module"))
        self._modules = frozenset({cls.__module__, sched_mod, __name__, f"{__package__}.trtllm_example"})
        self.inner = cls(_llm_args(ctx))

    def bind_connector_meta(self, metadata: ConnectorMetadata | None) -> None:
        super().bind_connector_meta(metadata)
        wire = metadata.to_wire() if metadata is not None else None
        self.inner.bind_connector_meta(None if wire is None else decode_meta(wire, self._modules))

    def _clear_connector_meta(self) -> None:
        super()._clear_connector_meta()
        self.inner._clear_connector_meta()

    def register_kv_caches(self, kv_cache_tensor: torch.Tensor) -> None:
        self.inner.register_kv_caches(kv_cache_tensor)

    def start_load_kv(self, stream: Any = None) -> None:
        self.inner.start_load_kv(stream)

    def wait_for_layer_load(self, layer_idx: int, stream: Any = None) -> None:
        self.inner.wait_for_layer_load(layer_idx, stream)

    def save_kv_layer(self, layer_idx: int, stream: Any = None) -> None:
        self.inner.save_kv_layer(layer_idx, stream)

    def wait_for_save(self, stream: Any = None) -> None:
        self.inner.wait_for_save(stream)

    def get_finished(self, finished_gen_req_ids: list[int],
                     started_loading_req_ids: list[int]) -> tuple[list[int], list[int]]:
        saved, loaded = self.inner.get_finished(list(finished_gen_req_ids), list(started_loading_req_ids))
        return list(saved), list(loaded)

    def get_load_errors(self) -> dict[int, str]:
        f = getattr(self.inner, "get_load_errors", None)
        return dict(f()) if callable(f) else {}

    def close(self) -> None:
        for hook in ("shutdown", "close"):
            if callable(getattr(self.inner, hook, None)):
                getattr(self.inner, hook)()
