"""A worker's state (config, executor backend, text codec, instance) and the work around requests that is
not request handling: releasing a refused context request's KV, the housekeeping loop, the error a request
that failed unexpectedly gets. worker_app.py holds the routes over it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from ..errors import KvBridgeError
from ..executor.transceiver_hook import context_request_of
from ..transceiver import DisaggParams
from .backend import Backend
from .config import ServeConfig, ServerSpec
from .protocol import ApiError
from .text import TextCodec

log = logging.getLogger("kvbridge.serving.worker")

__all__ = ["WorkerState", "release_context", "housekeeping", "internal_error"]


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
        err = st.backend.ex.error
        if err:
            st.failed = err
            log.error("%s: the executor failed, stopping the worker: %s", st.spec.name, err.splitlines()[0])
            on_fatal()
            return
