"""A worker's state (config, executor backend, text codec, instance) and the work around requests that is
not request handling: releasing a refused context request's KV, the housekeeping loop, the error a request
that failed unexpectedly gets, and the positional KV digests of its disaggregated requests
(`executor.kv_digests: true`: `DigestIndex` maps a request's wire handle to its executor request id here,
`kv_digest_answer` is GET /internal/kv_digests), and the watch on its executor's ranks (`watch_ranks`: a worker
whose HTTP server answers while its ranks answer nothing reports `stalled`). worker_app.py holds the routes
over it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ..errors import ExecutorError, KvBridgeError
from ..executor.kv_check import MAX_RECORDED, to_json
from ..executor.transceiver_hook import context_request_of
from ..transceiver import DisaggParams
from .backend import Backend
from .config import ServeConfig, ServerSpec
from .prefetches import Prefetches
from .protocol import ApiError
from .text import TextCodec

log = logging.getLogger("kvbridge.serving.worker")

__all__ = ["WorkerState", "DigestIndex", "release_context", "housekeeping", "internal_error",
           "kv_digest_answer", "watch_ranks", "watch_period_s"]

DIGEST_TIMEOUT_S = 30.0  # the ranks hash a request's KV between two steps: seconds, even for long prompts
_HANDLE_MAX = (1 << 63) - 1  # handles are positive int64 (transceiver/handles.py)
ANSWERS_KEPT = 256  # merged digests a worker keeps once asked for (a large model's is tens of kB)


class DigestIndex:
    """handle -> executor request id of this worker's last `limit` disaggregated requests, and the last `kept`
    answers once asked for (a rank hands a recorded digest over once; the worker keeps the merged one).
    Used on the event loop only; `lock` makes one digest fetch at a time."""

    def __init__(self, limit: int = MAX_RECORDED, kept: int = ANSWERS_KEPT) -> None:
        self.limit, self.kept = limit, kept
        self._rids: OrderedDict[int, int] = OrderedDict()
        self._answers: dict[int, dict] = {}
        self.lock = asyncio.Lock()

    def add(self, handle: int, request_id: int) -> None:
        self._rids[handle] = request_id
        self._answers.pop(handle, None)
        self._rids.move_to_end(handle)
        while len(self._rids) > self.limit:
            self._answers.pop(self._rids.popitem(last=False)[0], None)

    def request_of(self, handle: int) -> int | None:
        return self._rids.get(handle)

    def answer(self, handle: int) -> dict | None:
        return self._answers.get(handle)

    def keep(self, handle: int, answer: dict) -> None:
        if handle in self._rids:
            self._answers[handle] = answer
            while len(self._answers) > self.kept:
                self._answers.pop(next(iter(self._answers)))


@dataclass
class WorkerState:
    cfg: ServeConfig
    spec: ServerSpec
    backend: Backend
    codec: TextCodec
    instance: str
    endpoints: tuple[str, ...] = ()
    started: float = field(default_factory=time.time)
    failed: str | None = None
    draining: bool = False  # leaving a disagg_cluster (worker_cluster.py): /health answers 503 "draining"
    digests: DigestIndex = field(default_factory=DigestIndex)
    prefetched: Prefetches = field(default_factory=Prefetches)  # overlap: generation requests prefetched
    kv_events: dict | None = None  # {pub, replay, incarnation}: its KV event endpoints (kv_worker.py)
    ranks_heard: float = field(default_factory=time.monotonic)  # every rank last answered (watch_ranks)

    def executor_silence(self) -> float | None:
        """Seconds since every rank last answered the watch's probe, when that is longer than half of
        hang_timeout_s (the worker then reports `stalled`); None while they answer (or nothing watches)."""
        hang = self.cfg.hang_timeout_s
        silent = time.monotonic() - self.ranks_heard
        return silent if hang and silent > hang / 2 else None

    def record_handle(self, handle: int, request_id: int) -> None:
        """Remember a disaggregated request's wire handle (only when its executor records KV digests)."""
        if self.backend.ex.cfg.kv_digests:
            self.digests.add(handle, request_id)


def internal_error(name: str, e: BaseException) -> ApiError:
    log.exception("%s: a request failed unexpectedly", name, exc_info=e)
    return ApiError(500, f"{name} failed this request: {type(e).__name__}: {e}"[:500], "server_error",
                    "internal_error")


def release_context(st: WorkerState, d: Any) -> bool:
    """Drop the KV of a request this context worker prefilled and still pins (named by the disaggregated
    params it answered); False when there is nothing of ours to drop. Validated: this is network input."""
    from .protocol import parse_disagg

    req = parse_disagg(d)
    if req is None or req.request_type != "generation_only" or st.spec.role != "context":
        raise ApiError(400, "disaggregated_params: expected the generation_only object a context worker "
                            "answered", param="disaggregated_params")
    try:
        params = DisaggParams.from_dict(req.ctx_params)
    except KvBridgeError as e:
        raise ApiError(400, f"disaggregated_params.ctx_params: {e}", param="disaggregated_params") from None
    if params.ctx_instance != st.instance:
        return False
    rid = context_request_of(st.backend.ex, params, st.backend.pinned_ids())
    return rid is not None and st.backend.drop_context(rid)


async def housekeeping(st: WorkerState, on_fatal) -> None:
    """Every half second: fold in released context requests; stop the worker once its executor failed."""
    while True:
        await asyncio.sleep(0.5)
        if st.spec.role == "context":
            st.backend.collect_released()
        else:  # prefetches nobody claimed in time are aborted
            for rid in st.prefetched.expired(time.monotonic()):
                log.info("%s: prefetched request %d was not claimed in time; aborted", st.spec.name, rid)
                st.backend.abort(rid)
        err = st.backend.ex.error
        if err:
            st.failed = err
            log.error("%s: the executor failed, stopping the worker: %s", st.spec.name, err.splitlines()[0])
            on_fatal()
            return


def watch_period_s(hang_timeout_s: float) -> float:
    """How often watch_ranks probes: four probes per hang_timeout_s, at most one every 2 s."""
    return min(2.0, hang_timeout_s / 4)


async def watch_ranks(st: WorkerState) -> None:
    """Ask every rank for its block counts (one stats round between two steps) every watch_period_s and note
    when all answered: a rank stopped, deadlocked or wedged in a step leaves `ranks_heard` behind, and /health
    then says `stalled`. One probe at a time, each bounded by hang_timeout_s, on a thread of its own."""
    hang = st.cfg.hang_timeout_s
    while True:
        if await st.backend.ranks_answer(timeout=hang):  # False: no answer in time (the silence grows), or
            st.ranks_heard = time.monotonic()           # the executor failed (housekeeping stops the worker)
        await asyncio.sleep(watch_period_s(hang))


async def kv_digest_answer(st: WorkerState, raw: str | None) -> dict[str, Any]:
    """GET /internal/kv_digests?handle=H: the merged positional KV digest of this worker's disaggregated
    request H (the context side's at prefill, the generation side's once its KV arrived), in
    kv_check.to_json's form under "kv_digest". 409 when digests are off, 404 naming H when it is unknown."""
    name, be = st.spec.name, st.backend
    if not be.ex.cfg.kv_digests:
        raise ApiError(409, f"{name} records no KV digests: set executor.kv_digests: true for its server "
                            f"group", code="kv_digests_off")
    ok = raw is not None and raw.isascii() and raw.isdigit() and len(raw) <= 19
    handle = int(raw) if ok else 0
    if not 0 < handle <= _HANDLE_MAX:
        raise ApiError(400, f"handle: {raw!r:.40} is not a request handle (an integer 1..2^63-1)",
                       param="handle")
    async with st.digests.lock:
        got = st.digests.answer(handle)
        if got is not None:
            return got
        rid = st.digests.request_of(handle)
        if rid is None:
            raise ApiError(404, f"{name} ({st.spec.role}) has no disaggregated request with handle {handle} "
                                f"(never seen here, or older than its last {st.digests.limit})",
                           code="unknown_handle", param="handle")
        try:
            d = await be.call(lambda: be.ex.kv_digest(rid, timeout=DIGEST_TIMEOUT_S))
        except ExecutorError as e:
            if be.ex.error or str(e).startswith("timed out"):
                raise be.error(e, f"the KV digest of handle {handle}") from None
            raise ApiError(404, f"{name}: no KV digest of handle {handle}: {e}", code="kv_digest_missing",
                           param="handle") from None
        got = {"handle": handle, "worker": name, "role": st.spec.role, "kv_digest": to_json(d)}
        st.digests.keep(handle, got)
        return got
