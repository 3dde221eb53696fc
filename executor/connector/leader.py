"""The scheduler half's seat beside the engine, in the leader rank: hooks in TensorRT-LLM's order, ids in flight.

The engine (engine.py) calls, per request and per plan:

    admit(request)            admission of an aggregated / context-only request: get_num_new_matched_tokens.
                              A hit (> 0 tokens, whole blocks, short of the last prompt token) makes the engine
                              allocate the request's blocks in this plan (a ConnAlloc op) and wait for the load.
    plan_section(batch)       at the end of every plan it builds: update_state_after_alloc for the requests
                              allocated by the previous plan (their block ids are known now), then
                              build_connector_meta; returns the plan's `conn` section (wire.py).
    request_finished(request) an aggregated request finished / a context-only one was released: True keeps
                              its blocks (the engine defers the free) until every rank reported it saved.
    on_reports(reports)       after every step: the ranks' get_finished results, all-gathered; returns the
                              ids saved on every rank and the loads ended on every rank (with any error).

Reads block ids from rank 0's KV cache manager (which every rank mirrors); never changes it.
"""

from __future__ import annotations

import logging

from ...errors import ExecutorError
from ...kvcache.manager import KVCacheManager
from ..plan import BatchRow
from .base import ConnectorMetadata, ConnectorRequest, KvConnectorScheduler, RequestData, SchedulerOutput
from .factory import check_spec, load_class, make_context
from .wire import ConnReport, ConnSection, Tally

log = logging.getLogger(__name__)

__all__ = ["ConnectorLeader"]


def view(r) -> ConnectorRequest:
    """The scheduler's view of an engine Request."""
    return ConnectorRequest(r.request_id, tuple(r.prompt) + tuple(r.output), len(r.prompt), r.num_cached, r.mode)


class ConnectorLeader:
    """The connector's scheduler half and its bookkeeping, for the engine.

    Args:
        cfg: the executor config (its "kv_connector" spec).
        kv: rank 0's KV cache manager (block ids are read from it).
        model_config: the model's config dict.
    """

    def __init__(self, cfg: dict, kv: KVCacheManager, model_config: dict) -> None:
        spec = check_spec(cfg["kv_connector"])
        self.kv = kv
        self.tpb = kv.tokens_per_block
        self.scheduler: KvConnectorScheduler = load_class(spec, "scheduler")(
            make_context(spec, cfg, kv.layout, 0, kv.pool.device, model_config))
        self.tally = Tally(kv.layout.world_size)
        self._admitted: list[tuple[ConnectorRequest, bool]] = []   # this plan's hits (blocks not yet allocated)
        self._allocated: list[tuple[ConnectorRequest, bool]] = []  # the previous plan's (allocated now)
        self._saving: list[int] = []            # request_finished said True; not yet announced to the ranks
        self._loading: list[int] = []           # async loads not yet announced
        self._sync_sent: list[int] = []         # synchronous loads whose metadata went out in the last plan
        self._sync_next: list[int] = []
        self._loads: set[int] = set()           # announced, not yet ended on every rank
        self._saves: set[int] = set()
        self._reported: dict[int, int] = {}     # rid -> blocks already reported in a SchedulerOutput

    # --- engine hooks ---------------------------------------------------------------------------------
    def admit(self, r) -> int:
        """Prompt tokens the connector will load for a request being admitted (0: compute it all)."""
        v = view(r)
        n, load_async = self.scheduler.get_num_new_matched_tokens(v, 0)
        if type(n) is not int or n < 0:
            log.error("connector matched %r tokens for request %d; ignored", n, r.request_id)
            return 0
        if n == 0:
            return 0
        if n % self.tpb or n >= len(r.prompt):
            log.error("connector matched %d tokens for request %d (prompt %d tokens, %d per block): only whole "
                      "blocks short of the last prompt token can be loaded; computing it all", n,
                      r.request_id, len(r.prompt), self.tpb)
            return 0
        self._admitted.append((v, bool(load_async)))
        return n

    def request_finished(self, r) -> bool:
        """Whether the connector keeps the request's blocks while it saves them (see the module docstring)."""
        self._reported.pop(r.request_id, None)
        blocks = self.kv.get_batch_cache_indices([r.request_id])[0]
        if not self.scheduler.request_finished(view(r), blocks):
            return False
        self._saving.append(r.request_id)
        return True

    def plan_section(self, batch: list[BatchRow]) -> ConnSection:
        """The plan's connector section (call once per plan, after its batch is chosen)."""
        for v, load_async in self._allocated:
            rid = v.request_id
            self.scheduler.update_state_after_alloc(v, self.kv.get_batch_cache_indices([rid])[0])
            (self._loading if load_async else self._sync_next).append(rid)
        self._allocated, self._admitted = self._admitted, []
        meta = self.scheduler.build_connector_meta(self._output(batch))
        if meta is not None and not isinstance(meta, ConnectorMetadata):
            raise ExecutorError(f"connector build_connector_meta returned a {type(meta).__name__}, not a "
                                f"ConnectorMetadata")
        sec = ConnSection(None if meta is None else meta.to_wire(), tuple(self._saving), tuple(self._loading))
        self._saves.update(self._saving)
        self._loads.update(self._loading)
        self._saving, self._loading = [], []
        self._sync_sent, self._sync_next = self._sync_next, []
        return sec

    def _output(self, batch: list[BatchRow]) -> SchedulerOutput:
        out = SchedulerOutput()
        self._reported = {rid: n for rid, n in self._reported.items() if rid in self.kv}  # drop ended ones
        for row in batch:
            rid, start, toks = row.rid, row.start, row.tokens
            blocks = self.kv.get_batch_cache_indices([rid])[0] if rid in self.kv else []
            seen = self._reported.get(rid)
            data = RequestData(rid, list(toks), blocks[seen or 0:], start, len(toks))
            self._reported[rid] = len(blocks)
            (out.new_requests if seen is None else out.cached_requests).append(data)
        return out

    def has_work(self) -> bool:
        """A plan is needed now: allocations to report, or saves / loads to announce. (Loads and saves in
        flight are polled by the leader's idle rounds, every HOOK_IDLE_S while a request exists: spinning
        plans would take the CPU from the I/O threads.)"""
        return bool(self._allocated or self._saving or self._loading or self._sync_sent)

    def on_reports(self, reports: list[ConnReport]) -> tuple[list[int], list[tuple[int, str]]]:
        """Fold in one round of rank reports; returns (saved on every rank, [(loaded id, error or "")])."""
        saved, loaded = self.tally.add(reports)
        for rid in saved:
            self._saves.discard(rid)
        for rid, _ in loaded:
            self._loads.discard(rid)
        loaded += [(rid, self.tally.errors.pop(rid, "")) for rid in self._sync_sent]
        self._sync_sent = []
        for rid, err in loaded:
            if err:
                log.warning("connector load of request %d failed (%s); computing its whole prompt", rid, err)
        return saved, loaded

    def close(self) -> None:
        self.scheduler.close()
