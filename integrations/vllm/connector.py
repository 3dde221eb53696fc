"""KVBridgeConnector: kvbridge as a vLLM v1 KV connector (`KVConnectorBase_V1`). The only module here that
imports vllm.

    --kv-transfer-config '{"kv_connector": "KVBridgeConnector",
        "kv_connector_module_path": "kvbridge.integrations.vllm.connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"transceiver": {<TransceiverConfig keys>}, "kv_digest_dir": null}}'

vLLM builds one connector in the scheduler (engine-core process) and one in every worker. The hooks, who
calls each and what it may do (vLLM's own contract, kv_connector/v1/base.py):

| hook | side, caller | here |
| --- | --- | --- |
| register_kv_caches | worker, once after the cache is allocated | describe the tensors (layout.py), start the rank's Sender / Receiver |
| get_handshake_metadata | worker, once after that | this rank's control endpoint + layout -> the scheduler |
| set_xfer_handshake_metadata_pp_aware | scheduler, once | every rank's endpoint, by kvbridge rank |
| get_num_new_matched_tokens | scheduler, maybe several times per request; side-effect free | remote tokens beyond the local prefix, loaded asynchronously |
| update_state_after_alloc | scheduler, after the blocks are allocated | queue the pull (or the refusal of bad params) |
| build_connector_meta | scheduler, every step | hand this step's work to the workers |
| start_load_kv | worker, every step (also steps without a forward) | publish, start pulls, cancel |
| get_transfer_results | worker, every step | finished sends / receives / failed receives; a step with no forward first waits up to `idle_wait_ms` for a pull |
| build_connector_worker_meta / update_connector_output | worker -> scheduler, every step | pull stats |
| request_finished | scheduler, once per request, before its blocks are freed | prefill: keep the blocks, answer kvbridge's kv_transfer_params; decode: cancel a pull in flight |
| save_kv_layer | worker, after each attention layer wrote its KV | early decode: the streamed requests' layers up to it are readable |
| wait_for_save | worker, after the forward | early decode: every layer readable |
| wait_for_layer_load | worker, before each attention layer | nothing: a decode request waits for its whole KV (async load) |
| shutdown | worker, at exit | close the transceiver (agents, sockets, registrations) |

A failed pull is reported as a failed receive, so vLLM fails the request or recomputes it locally as its
`kv_load_failure_policy` says; a request is never decoded on KV that did not arrive whole.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)

from ...formatter.layout import KVLayout, ParallelSplit, KVShape
from ...transceiver.config import TransceiverConfig
from .layout import DTYPE_NAMES, PACKED_ORDERS, EngineShape, describe_caches
from .packing import Packing, probe
from .scheduler import SchedulerSide
from .work import IDLE_WAIT_MS, PullStats, StepWork, idle_wait_s
from .worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

__all__ = ["KVBridgeConnector"]

_TORCH_DTYPES = {name: dt for dt, name in DTYPE_NAMES.items()}


class KVBridgeMeta(KVConnectorMetadata):
    def __init__(self, work: StepWork) -> None:
        self.work = work


class KVBridgeHandshake(KVConnectorHandshakeMetadata):
    """One worker's control endpoint and KV layout (wire form), sent to the scheduler once."""

    def __init__(self, rank: int, endpoint: str, layout: dict, packing: str = "") -> None:
        self.rank, self.endpoint, self.layout, self.packing = rank, endpoint, layout, packing


class KVBridgeWorkerMeta(KVConnectorWorkerMetadata):
    def __init__(self, stats: dict[str, PullStats]) -> None:
        self.stats = stats

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KVConnectorWorkerMetadata":
        merged = dict(self.stats)
        for k, v in getattr(other, "stats", {}).items():
            merged[k] = merged[k].merge(v) if k in merged else v
        return KVBridgeWorkerMeta(merged)


def engine_shape(vllm_config: "VllmConfig") -> EngineShape:
    """The KV cache geometry and split vLLM's config describes."""
    from vllm.distributed.utils import get_pp_indices

    m, p, c = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    layers = m.get_total_num_hidden_layers()
    pp = p.pipeline_parallel_size
    stages = tuple(b - a for a, b in (get_pp_indices(layers, r, pp) for r in range(pp)))
    mla = bool(getattr(m, "use_mla", False))
    dtype = m.dtype if c.cache_dtype in (None, "auto") else {
        "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}.get(
        c.cache_dtype, m.dtype)
    head_dim = m.get_head_size()
    return EngineShape(layers, 1 if mla else m.get_total_num_kv_heads(), head_dim,
                       DTYPE_NAMES.get(dtype, "float32"), c.block_size, p.tensor_parallel_size, pp, stages, mla)


class KVBridgeConnector(KVConnectorBase_V1):
    """kvbridge's KV connector for vLLM (module docstring: the hooks and what each does)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = self._kv_transfer_config
        extra = dict(ktc.kv_connector_extra_config or {})
        tc = dict(extra.get("transceiver") or {})
        # NIXL times kvbridge's READs as vLLM's NixlConnector has it time its own (`transport_ms` in the answer)
        opts = tc.get("options")
        if opts is None or isinstance(opts, dict):  # anything else: TransceiverConfig names what is wrong
            opts = dict(opts or {})
            if opts.get("nixl") is None or isinstance(opts["nixl"], dict):
                opts["nixl"] = {"telemetry": True, **(opts.get("nixl") or {})}
            tc["options"] = opts
        # an early decode's Fetch may come while its prefill still waits in vLLM's queue: a prefill engine
        # keeps it for the decode's whole transfer deadline unless told otherwise (params.py: early decode)
        tc.setdefault("publish_wait_s", float(tc.get("transfer_timeout_s") or TransceiverConfig.transfer_timeout_s))
        self._config = TransceiverConfig.from_dict(tc)
        self._digest_dir = extra.get("kv_digest_dir")
        self._idle_wait_s = idle_wait_s(extra.get("idle_wait_ms", IDLE_WAIT_MS))
        self._instance = f"vllm-{ktc.engine_id}"
        self._produce, self._consume = bool(ktc.is_kv_producer), bool(ktc.is_kv_consumer)
        self._shape = engine_shape(vllm_config)
        self._cache_dtype = str(vllm_config.cache_config.cache_dtype or "auto")
        # a staging pool for a prefill of another block size holds this many tokens (reblock.py)
        self._staging_tokens = max(int(extra.get("staging_tokens") or 0),
                                   int(vllm_config.model_config.max_model_len))
        self._packings: dict[int, Packing] = {}
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            s = self._shape
            local = KVLayout(KVShape(s.num_layers, s.num_kv_heads, s.head_dim, s.dtype, s.block_size, s.mla),
                             ParallelSplit(s.tp, s.pp, s.layers_per_stage))
            self._sched = SchedulerSide(self._instance, local)

    # --- worker side ---------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group
        from vllm.model_executor.models.utils import extract_layer_index

        pool = describe_caches(self._shape, get_tp_group().rank_in_group, get_pp_group().rank_in_group,
                               kv_caches, extract_layer_index)
        log.info("kvbridge: rank %d KV cache: %s", pool.rank, pool.layout.describe())
        self._worker = WorkerSide(pool, self._config, self._instance, self._produce, self._consume,
                                  self._digest_dir, self._packing_of if pool.layout.order in PACKED_ORDERS else None,
                                  self._staging_tokens)
        self._worker.set_layer_names(sorted(kv_caches, key=extract_layer_index))

    def _packing_of(self, tokens_per_block: int) -> Packing:
        """vLLM's CPU attention kernel's packing for a block size, learned from its own store op (cached)."""
        got = self._packings.get(tokens_per_block)
        if got is None:
            from vllm import _custom_ops as ops
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            s, kv_dtype = self._shape, self._cache_dtype
            dtype = _TORCH_DTYPES[s.dtype]
            isa = _get_attn_isa(dtype, tokens_per_block, s.head_dim, kv_dtype)

            def store(k, v, kc, vc, slots):
                ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa, kv_cache_dtype=kv_dtype)

            got = self._packings[tokens_per_block] = probe(store, isa, tokens_per_block, s.head_dim, dtype)
        return got

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        w = self._worker
        if w is None:
            return None
        return KVBridgeHandshake(w.cache.rank, w.endpoint or "", w.cache.layout.to_wire(),
                                 w.packing.digest if w.packing is not None else "")

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        if self._worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, KVBridgeMeta) and meta.work:
                self._worker.apply(meta.work)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.layer_saved(layer_name)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.forward_done()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if isinstance(meta, KVBridgeMeta) and meta.work.idle:
            self._worker.wait_pulls(self._idle_wait_s)
        sending, recving, failed = self._worker.poll()
        return KVConnectorTransferResults(sending, recving, failed)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._worker is None:
            return None
        stats = self._worker.take_stats()
        return KVBridgeWorkerMeta(stats) if stats else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    # --- scheduler side ------------------------------------------------------------------------------
    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict) -> None:
        eps, lays, packs = {}, {}, {}
        for meta in metadata.values():
            if isinstance(meta, KVBridgeHandshake):
                eps[meta.rank], lays[meta.rank], packs[meta.rank] = meta.endpoint, meta.layout, meta.packing
        if self._sched is not None and eps:
            self._sched.set_workers(eps, lays, packs)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        sp = request.sampling_params
        return self._sched.matched_tokens(request.request_id, request.kv_transfer_params,
                                          list(request.prompt_token_ids or ()), num_computed_tokens,
                                          sp.max_tokens if sp is not None else None)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        if num_external_tokens > 0:
            self._sched.after_alloc(request.request_id, list(blocks.get_block_ids()[0]), num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVBridgeMeta(self._sched.take_work(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        stats = meta.stats if isinstance(meta, KVBridgeWorkerMeta) else {}
        self._sched.worker_reports(stats, connector_output.finished_recving)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        ok = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        ids = list(block_ids[0]) if block_ids and isinstance(block_ids[0], (list, tuple)) else list(block_ids)
        return self._sched.request_finished(request.request_id, request.kv_transfer_params,
                                            list(request.prompt_token_ids or ()), request.num_computed_tokens,
                                            ok, ids)
