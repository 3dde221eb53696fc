"""kvbridge's persistent KV store as a TensorRT-LLM KV Cache Connector (`LLM(kv_connector_config=...)`).

    import os
    from tensorrt_llm import LLM
    from tensorrt_llm.llmapi.llm_args import KvCacheConnectorConfig
    os.environ["KVBRIDGE_KV_STORE"] = "/data/kvstore"            # KVBRIDGE_KV_STORE_MAX_BYTES: the bound
    llm = LLM(model="...", kv_connector_config=KvCacheConnectorConfig(
        connector_module="kvbridge.executor.connector.trtllm",
        connector_scheduler_class="KvBridgeStoreScheduler",
        connector_worker_class="KvBridgeStoreWorker"))

UNTESTED against a live TensorRT-LLM (none can run here): a thin translation onto the persistent connector
(persistent.py) that kvbridge's own executor runs and tests. Importing this module never fails; building
either class without TensorRT-LLM raises ImportError saying so. Known limits:
- TensorRT-LLM's connector API has no load-failure path: a stored block that vanishes (evicted by another
  instance) or fails its checksum between the match and the load is logged as an error, and that request's
  prefix KV is wrong. kvbridge's executor recomputes the request instead.
- The namespace is built from the model path, tokens per block, TP/PP and the KV dtype (not our KVLayout):
  set KVBRIDGE_KV_STORE_NAMESPACE to add a weights revision.
- Metadata crosses TensorRT-LLM's ranks as msgpack bytes (TensorRT-LLM pickles what it broadcasts; we hand it
  bytes only, and decode them with the strict codec).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from ... import codec
from .base import ConnectorContext, ConnectorRequest, RequestData, SchedulerOutput
from .keys import namespace_from
from .persistent import PersistentKvConnectorScheduler, PersistentKvConnectorWorker, PersistentMeta

log = logging.getLogger(__name__)

__all__ = ["TRTLLM_IMPORT_ERROR", "KvBridgeStoreScheduler", "KvBridgeStoreWorker"]

try:  # the module imports without TensorRT-LLM; the classes refuse to be built without it
    from tensorrt_llm._torch.pyexecutor.kv_cache_connector import KvCacheConnectorScheduler as _TrtScheduler
    from tensorrt_llm._torch.pyexecutor.kv_cache_connector import KvCacheConnectorWorker as _TrtWorker

    TRTLLM_IMPORT_ERROR: Exception | None = None
except Exception as e:  # noqa: BLE001 - ImportError, or whatever a broken install raises on import
    _TrtScheduler = _TrtWorker = object
    TRTLLM_IMPORT_ERROR = e


def _require() -> None:
    if TRTLLM_IMPORT_ERROR is not None:
        raise ImportError(
            f"kvbridge.executor.connector.trtllm needs TensorRT-LLM "
            f"(tensorrt_llm._torch.pyexecutor.kv_cache_connector), which cannot be imported here "
            f"({type(TRTLLM_IMPORT_ERROR).__name__}: {TRTLLM_IMPORT_ERROR}). Install TensorRT-LLM, or run the "
            f"same store with kvbridge's executor: ExecutorConfig(kv_connector_config="
            f"KvConnectorConfig.persistent(root)).")


def _context(llm_args: Any, rank: int) -> ConnectorContext:
    root = os.environ.get("KVBRIDGE_KV_STORE", "./kvbridge_kv_store")
    tpb = int(llm_args.kv_cache_config.tokens_per_block)
    tp = int(getattr(llm_args, "tensor_parallel_size", 1) or 1)
    pp = int(getattr(llm_args, "pipeline_parallel_size", 1) or 1)
    model = str(getattr(llm_args, "model", ""))
    dtype = str(getattr(llm_args.kv_cache_config, "dtype", "auto"))
    ns = namespace_from("tensorrt-llm", model, f"tpb={tpb}", f"tp={tp}", f"pp={pp}", f"kv_dtype={dtype}",
                        os.environ.get("KVBRIDGE_KV_STORE_NAMESPACE", ""))
    dev = torch.device(f"cuda:{torch.cuda.current_device()}") if torch.cuda.is_available() else torch.device("cpu")
    args = {"root": root, "max_bytes": int(os.environ.get("KVBRIDGE_KV_STORE_MAX_BYTES", "0"))}
    return ConnectorContext(rank, tp * pp, tpb, ns, model, dev, 0, args)


def _view(request: Any, num_computed_tokens: int | None = None) -> ConnectorRequest:
    """A TensorRT-LLM LlmRequest as the persistent connector's request view."""
    tokens = tuple(int(t) for t in request.get_tokens(0))
    prompt_len = int(getattr(request, "prompt_len", len(tokens)))
    if num_computed_tokens is None:  # a finished request: every token but the last generated one has KV
        num_computed_tokens = len(tokens) - 1 if len(tokens) > prompt_len else prompt_len
    return ConnectorRequest(int(request.request_id), tokens, prompt_len, int(num_computed_tokens))


def _output(so: Any) -> SchedulerOutput:
    """TensorRT-LLM's SchedulerOutput as ours (the same field names); None: an empty one."""
    def rows(rs: Any) -> list[RequestData]:
        return [RequestData(int(r.request_id), list(r.new_tokens), list(r.new_block_ids), int(r.computed_position),
                            int(r.num_scheduled_tokens)) for r in rs or ()]

    if so is None:
        return SchedulerOutput()
    return SchedulerOutput(rows(so.new_requests), rows(so.cached_requests))


class KvBridgeStoreScheduler(_TrtScheduler):
    """TensorRT-LLM scheduler half (rank 0) over kvbridge's PersistentKvConnectorScheduler."""

    def __init__(self, llm_args: Any) -> None:
        _require()
        super().__init__(llm_args)
        self._inner = PersistentKvConnectorScheduler(_context(llm_args, 0))

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return self._inner.get_num_new_matched_tokens(_view(request, num_computed_tokens), num_computed_tokens)

    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        self._inner.update_state_after_alloc(_view(request, 0), list(block_ids))

    def build_connector_meta(self, scheduler_output: Any) -> bytes | None:
        meta = self._inner.build_connector_meta(_output(scheduler_output))
        return None if meta is None else codec.pack(meta.to_wire())

    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        return self._inner.request_finished(_view(request), list(cache_block_ids))


class KvBridgeStoreWorker(_TrtWorker):
    """TensorRT-LLM worker half (every rank) over kvbridge's PersistentKvConnectorWorker."""

    def __init__(self, llm_args: Any) -> None:
        _require()
        super().__init__(llm_args)
        from tensorrt_llm._utils import mpi_rank

        self._inner = PersistentKvConnectorWorker(_context(llm_args, int(mpi_rank())))

    def bind_connector_meta(self, metadata: Any) -> None:
        super().bind_connector_meta(metadata)
        self._inner.bind_connector_meta(
            None if metadata is None else PersistentMeta.from_wire(codec.unpack(metadata, what="connector metadata")))

    def register_kv_caches(self, kv_cache_tensor: torch.Tensor) -> None:
        self._inner.register_kv_caches(kv_cache_tensor)

    def start_load_kv(self, stream: Any) -> None:
        self._inner.start_load_kv(stream)

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        self._inner.wait_for_layer_load(layer_idx, stream)

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        self._inner.save_kv_layer(layer_idx, stream)

    def wait_for_save(self, stream: Any) -> None:
        self._inner.wait_for_save(stream)

    def get_finished(self, finished_gen_req_ids: list[int],
                     started_loading_req_ids: list[int]) -> tuple[list[int], list[int]]:
        saved, loaded = self._inner.get_finished(finished_gen_req_ids, started_loading_req_ids)
        for rid, why in self._inner.get_load_errors().items():
            log.error("kvbridge KV store: load of request %d failed (%s); TensorRT-LLM has no way to recompute "
                      "it, so its prefix KV is wrong", rid, why)
        return saved, loaded
