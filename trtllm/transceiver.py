"""`KvCacheTransceiver` with TensorRT-LLM's method set, over kvbridge's CacheTransceiver, for LlmRequests.

Owns the requests in flight of one rank and their state moves (llm_request.py); kvbridge's Sender/Receiver
move the bytes. Pins a context request's blocks in the KVCacheManager from respond_and_send_async until its
transfer ends, so freeing it early cannot hand its blocks to another request; never frees blocks itself.
Every wait is bounded (kv_transfer_timeout_ms, kv_transfer_sender_future_timeout_ms, or the call's own).

Called by the executor's thread, the way PyExecutor calls upstream's transceiver:

    respond_and_send_async(req)          context: after the prefill. CONTEXT_INIT/GENERATION_* ->
                                         DISAGG_CONTEXT_TRANS_IN_PROGRESS; sets req.context_phase_params.
    check_context_transfer_status(n)     context: poll (n=0), wait for n, or None: wait for all in flight
                                         (at most kv_transfer_sender_future_timeout_ms, then what ended).
                                         -> (completed ids, error ids); states DISAGG_CONTEXT_COMPLETE or
                                         DISAGG_TRANS_ERROR; the blocks may be freed now.
    request_and_receive_async(req)       generation: after prepare_resources gave it blocks.
                                         DISAGG_GENERATION_INIT -> DISAGG_GENERATION_TRANS_IN_PROGRESS.
    request_and_receive_sync(req)        the same, then waits for it: -> DISAGG_GENERATION_TRANS_COMPLETE.
    check_gen_transfer_status(n)         generation: as check_context_transfer_status; a completed request is
                                         DISAGG_GENERATION_TRANS_COMPLETE and may decode.
    check_gen_transfer_complete()        True when no pull is in flight.
    cancel_request(req) -> bool          stop a transfer in flight; it ends in DISAGG_TRANS_ERROR (reported by
                                         the next status call, after its reads settled).
    prepare_context_requests(requests)   context-first only: waiting requests -> CONTEXT_INIT.
    shutdown()                           close both sides (idempotent); requests in flight end in
                                         DISAGG_TRANS_ERROR, their pins dropped; later calls raise.

Multi-rank executors pass `all_gather` (this rank's list -> every rank's lists) so endpoints are exchanged
once and a request completes only when every rank finished it (Agreement).
"""

from __future__ import annotations

import time
from typing import Callable

from ..errors import DeadlineExceeded, KvBridgeError
from ..transceiver.agreement import Agreement
from ..transceiver.cache_transceiver import CacheTransceiver
from ..transceiver.handles import RequestKey
from ..transceiver.params import DisaggParams
from ..transceiver.upstream import CacheTransceiverConfig
from .kv_cache_manager import KVCacheManager
from .llm_request import LlmRequest, LlmRequestState as S

__all__ = ["KvCacheTransceiver", "create_kv_cache_transceiver"]

AllGather = Callable[[list], list[list]]
_SEND_FROM = (S.CONTEXT_INIT, S.GENERATION_IN_PROGRESS, S.GENERATION_TO_COMPLETE, S.GENERATION_COMPLETE)


class KvCacheTransceiver:
    """One rank's transceiver (both roles, each built on first use).

    Args:
        kv_cache_manager: this rank's manager (its pool is registered with the agents).
        config: upstream's cache_transceiver_config (None: all defaults).
        instance: this executor's instance id (changes when it restarts).
        all_gather: exchanges a list of ints/strings across the executor's ranks (None: one rank).
        overrides: other TransceiverConfig fields (bind_host, lease_s, ...).
    """

    def __init__(self, kv_cache_manager: KVCacheManager, config: CacheTransceiverConfig | None = None, *,
                 instance: str | None = None, all_gather: AllGather | None = None, **overrides) -> None:
        self.kv = kv_cache_manager
        self.config = config or CacheTransceiverConfig()
        layout = kv_cache_manager.layout
        bpt = layout.block_bytes(kv_cache_manager.mapping.rank) // layout.shape.tokens_per_block
        self._xcfg = self.config.to_transceiver_config(bpt, **overrides)
        self._instance = instance
        self._gather = all_gather or (lambda mine: [mine])
        self._ctx: CacheTransceiver | None = None
        self._gen: CacheTransceiver | None = None
        self._endpoints: tuple[str, ...] | None = None
        self._key: RequestKey | None = None
        self._sending: dict[int, LlmRequest] = {}
        self._receiving: dict[int, LlmRequest] = {}
        self._agree_send, self._agree_recv = Agreement(), Agreement()
        self._unclaimed: list[tuple[int, bool]] = []  # pulls that ended during a sync wait for another one
        self._closed = False

    # --- context side -----------------------------------------------------------------------------------
    def respond_and_send_async(self, req: LlmRequest) -> None:
        """Offer a prefilled request's KV to generation ranks; sets req.context_phase_params."""
        self._alive("respond_and_send_async")
        if req.state not in _SEND_FROM:
            raise KvBridgeError(f"respond_and_send_async: request {req.request_id} is {req.state.name}, not "
                                f"past its context phase")
        ctx = self._context()
        blocks = self.kv.impl.pin(req.request_id)  # held until the transfer ends, even if freed meanwhile
        try:
            secret = self._request_key().secret(req.request_id)  # the same on every rank of this executor
            ctx.respond_and_send_async(_Publish(req.request_id, blocks, req.prompt_len, secret))
        except BaseException:
            self.kv.impl.unpin(req.request_id)
            raise
        self._sending[req.request_id] = req
        req.state = S.DISAGG_CONTEXT_TRANS_IN_PROGRESS
        req.context_phase_params = DisaggParams(req.request_id, ctx.instance, self._context_endpoints(),
                                                self.kv.layout, secret)

    def check_context_transfer_status(self, at_least_request_num: int | None = 0
                                      ) -> tuple[list[int], list[int]]:
        """(completed ids, error ids) of context transfers ended on every rank; see the module docstring."""
        self._alive("check_context_transfer_status")
        if self._ctx is None:
            return [], []
        future_ms = self.config.kv_transfer_sender_future_timeout_ms
        bound = future_ms / 1000.0 if future_ms else self._xcfg.pickup_timeout_s
        done = self._wait(self._sending, self._ctx.check_context_transfer_status, self._agree_send,
                          at_least_request_num, bound, partial=True)
        ok, bad = [], []
        for rid, success, why in done:
            req = self._sending.pop(rid)
            self.kv.impl.unpin(rid)
            req.state = S.DISAGG_CONTEXT_COMPLETE if success else S.DISAGG_TRANS_ERROR
            req.error = "" if success else why
            (ok if success else bad).append(rid)
        return ok, bad

    # --- generation side --------------------------------------------------------------------------------
    def request_and_receive_async(self, req: LlmRequest) -> None:
        """Start pulling req's prompt KV (req.context_phase_params) into its blocks."""
        self._alive("request_and_receive_async")
        if req.state is not S.DISAGG_GENERATION_INIT:
            raise KvBridgeError(f"request_and_receive_async: request {req.request_id} is {req.state.name}, "
                                f"not DISAGG_GENERATION_INIT")
        blocks = self.kv.get_cache_indices(req)  # KVCacheError when prepare_resources gave it none
        self._generation().request_and_receive_async(_Pull(req.request_id, req.disagg_params(), blocks,
                                                           req.prompt_len))
        self._receiving[req.request_id] = req
        req.state = S.DISAGG_GENERATION_TRANS_IN_PROGRESS

    def request_and_receive_sync(self, req: LlmRequest) -> None:
        """Pull req's prompt KV and wait for it (kv_transfer_timeout_ms): TRANS_COMPLETE or TRANS_ERROR.
        Other pulls that end meanwhile are reported by the next check_gen_transfer_status."""
        self.request_and_receive_async(req)
        deadline = time.monotonic() + self._xcfg.transfer_timeout_s + self._xcfg.drain_timeout_s
        while req.state is S.DISAGG_GENERATION_TRANS_IN_PROGRESS:
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(f"request {req.request_id}: no transfer result within "
                                       f"{self._xcfg.transfer_timeout_s:g} s")
            self._unclaimed += self._gen_results(1)
        self._unclaimed = [d for d in self._unclaimed if d[0] != req.request_id]

    def check_gen_transfer_status(self, at_least_request_num: int | None = 0) -> tuple[list[int], list[int]]:
        """(completed ids, error ids) of pulls ended on every rank; completed requests may decode."""
        self._alive("check_gen_transfer_status")
        done, self._unclaimed = self._unclaimed, []
        if self._gen is not None:
            need = None if at_least_request_num is None else max(0, at_least_request_num - len(done))
            done += self._gen_results(need)
        return [rid for rid, ok in done if ok], [rid for rid, ok in done if not ok]

    def _gen_results(self, at_least: int | None) -> list[tuple[int, bool]]:
        """Wait for pulls ending (see _wait) and move their requests' states."""
        done = self._wait(self._receiving, self._gen.check_gen_transfer_status, self._agree_recv, at_least,
                          self._xcfg.transfer_timeout_s + self._xcfg.drain_timeout_s)
        for rid, success, why in done:
            req = self._receiving.pop(rid)
            if success:
                self.kv.impl.mark_ready(rid)
                req.state = S.DISAGG_GENERATION_TRANS_COMPLETE
            else:
                req.state, req.error = S.DISAGG_TRANS_ERROR, why
        return [(rid, success) for rid, success, _ in done]

    def check_gen_transfer_complete(self) -> bool:
        return not self._receiving

    # --- both -------------------------------------------------------------------------------------------
    def cancel_request(self, req: LlmRequest) -> bool:
        """Stop req's transfer in flight (True), or say there is none (False)."""
        self._alive("cancel_request")
        rid = req.request_id
        side = self._ctx if rid in self._sending else self._gen if rid in self._receiving else None
        if side is None:
            return False
        side.cancel_request(rid)
        return True

    def prepare_context_requests(self, requests: list[LlmRequest]) -> None:
        """kvbridge is context-first: a request waiting for the scheduler may be scheduled at once."""
        self._alive("prepare_context_requests")
        for r in requests:
            if r.state in (S.DISAGG_CONTEXT_WAIT_SCHEDULER, S.UNKNOWN):
                r.state = S.CONTEXT_INIT

    def get_disaggregated_params(self) -> dict:
        """Generation-first mode is not supported: nothing to seed a generation request with."""
        return {}

    def shutdown(self) -> None:
        """Close both sides (their in-flight transfers end); idempotent."""
        if self._closed:
            return
        self._closed = True
        for side in (self._ctx, self._gen):
            if side is not None:
                side.close()
        for rid, req in self._sending.items():  # pins go; the executor frees these as on any error
            self.kv.impl.unpin(rid)
            req.state, req.error = S.DISAGG_TRANS_ERROR, "the transceiver was shut down"
        for req in self._receiving.values():
            req.state, req.error = S.DISAGG_TRANS_ERROR, "the transceiver was shut down"
        self._sending.clear()
        self._receiving.clear()

    def __enter__(self) -> "KvCacheTransceiver":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # --- internals --------------------------------------------------------------------------------------
    def _alive(self, what: str) -> None:
        if self._closed:
            raise KvBridgeError(f"{what}: the KvCacheTransceiver was shut down")

    def _context(self) -> CacheTransceiver:
        if self._ctx is None:
            m = self.kv
            self._ctx = CacheTransceiver.context(m.pool, m.layout, m.mapping.rank, m.impl.num_blocks,
                                                 self._xcfg, self._instance)
        return self._ctx

    def _generation(self) -> CacheTransceiver:
        if self._gen is None:
            m = self.kv
            self._gen = CacheTransceiver.generation(m.pool, m.layout, m.mapping.rank, m.impl.num_blocks,
                                                    self._xcfg, self._instance)
        return self._gen

    def _request_key(self) -> RequestKey:
        """This executor's key for per-request secrets: rank 0's, agreed through all_gather once."""
        if self._key is None:
            lists = self._gather([RequestKey.new().hex])
            self._key = RequestKey.from_hex(lists[0][0])
        return self._key

    def _context_endpoints(self) -> tuple[str, ...]:
        if self._endpoints is None:
            lists = self._gather([self._context().endpoint])
            self._endpoints = tuple(e for lst in lists for e in lst)
        return self._endpoints

    def _wait(self, in_flight: dict, poll, agreement: Agreement, at_least: int | None, bound_s: float,
              partial: bool = False) -> list[tuple[int, bool, str]]:
        """Poll until `at_least` (None: all in flight) ended on every rank, within bound_s; past it return
        what ended (partial, upstream's sender future timeout) or raise DeadlineExceeded."""
        want = len(in_flight) if at_least is None else min(int(at_least), len(in_flight))
        deadline = time.monotonic() + bound_s
        out: list[tuple[int, bool, str]] = []
        while True:
            results = poll()
            agreement.add(results)
            out += [(_rid(r), ok, _why(r) or ("" if ok else "failed on another rank"))
                    for r, ok in agreement.agree(self._gather) if _rid(r) in in_flight]
            if len(out) >= want:
                return out
            if time.monotonic() >= deadline:
                if partial:
                    return out
                raise DeadlineExceeded(f"{len(out)} of {want} transfers ended within {bound_s:g} s")
            time.sleep(0.002)


class _Publish:
    """What CacheTransceiver.respond_and_send_async reads."""

    def __init__(self, request_id: int, block_ids: list[int], num_tokens: int, secret: bytes) -> None:
        self.request_id, self.block_ids, self.num_tokens, self.secret = request_id, block_ids, num_tokens, secret


class _Pull:
    """What CacheTransceiver.request_and_receive_async reads."""

    def __init__(self, request_id: int, params: DisaggParams, block_ids: list[int], num_tokens: int) -> None:
        self.request_id, self.disagg_params, self.block_ids, self.num_tokens = (request_id, params, block_ids,
                                                                                num_tokens)


def _rid(r) -> int:
    rid = getattr(r, "request_id", None)
    return r.ctx_request_id if rid is None else rid


def _why(r) -> str:
    if hasattr(r, "ok"):
        return "" if r.ok else f"{r.error_type}: {r.error}"
    return "" if r.status == "complete" else f"{r.status}: {r.detail}"


def create_kv_cache_transceiver(mapping, kv_cache_manager: KVCacheManager,
                                cache_transceiver_config: CacheTransceiverConfig | dict | None = None,
                                **kw) -> KvCacheTransceiver:
    """Upstream's factory spelling (mapping is read from the manager; passed for signature compatibility)."""
    cfg = cache_transceiver_config
    if isinstance(cfg, dict):
        cfg = CacheTransceiverConfig.from_dict(cfg)
    return KvCacheTransceiver(kv_cache_manager, cfg, **kw)
