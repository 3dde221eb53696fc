"""The transceiver as a rank hook: every rank of an executor moves its own share of the KV.

Start an executor with
    rank_hook="kvbridge.executor.transceiver_hook:make",
    rank_hook_args={"role": "context"|"generation", "instance": "<executor id>", "transceiver": {...config...},
                    "run_dir": "<folder for endpoint files>"}
and every rank builds a CacheTransceiver over its pool (registered once). An aborted request reaches every
rank's hook (on_abort): the transfer is cancelled and its blocks are freed only after it settled everywhere.
Context ranks write their control endpoint to run_dir/endpoint-<rank> (read with `context_endpoints`); they publish each context-only request
when its prefill is done (with ExecutorConfig.stream_layers: when its blocks are allocated, marking layers
ready as the forward pass writes them, executor/streaming.py) and report "release" once their readers
confirmed (or the lease ran out).
Generation ranks pull each generation-only request named by ctx_info["disagg_params"] and report "kv_ready"
with the pull's TransferStats (transceiver/stats.py), or "abort" with the transfer's error; with block reuse they read only the tokens after
ctx_info["reused_tokens"] (set by the executor: its blocks already hold that prefix). The executor frees or
starts a request only when every rank agrees.

Request handles: a context executor's rank_hook_args carry its RequestKey (made by hooked_executor_config);
each rank publishes executor request `rid` under the wire id key.handle(rid) with the secret key.secret(rid)
(transceiver/handles.py), and the process that started the executor builds the matching DisaggParams with
`disagg_params(ex, rid, endpoints)`. The executor's own ids never reach the wire.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ExecutorError
from ..transceiver import CacheTransceiver, DisaggParams, TransceiverConfig
from ..transceiver.config import ConfigError, portable
from ..transceiver.handles import RequestKey
from ..transceiver.stats import of as transfer_stats
from .hooks import RankContext

log = logging.getLogger(__name__)

__all__ = ["TransceiverHook", "make", "context_endpoints", "hooked_executor_config", "disagg_params", "HOOK"]

HOOK = "kvbridge.executor.transceiver_hook:make"


def hooked_executor_config(role: str, instance: str, run_dir, transceiver: dict | None = None, **executor_kw):
    """An ExecutorConfig whose every rank runs the transceiver (this module's hook).

    Args:
        role: "context" or "generation".
        instance: the executor's id, the same on all its ranks.
        run_dir: folder where context ranks publish their control endpoints (`context_endpoints`).
        transceiver: TransceiverConfig settings as a mapping.
        executor_kw: the other ExecutorConfig fields (model, tp, pp, num_blocks, device, ...).

    A context executor also gets a fresh RequestKey (rank_hook_args["request_key"]): see `disagg_params`.
    """
    from .runtime import ExecutorConfig  # runtime imports torch and the worker; only where an executor starts

    # the ranks get their config as msgpack: rank_options' ranks travel as strings
    args = {"role": role, "instance": instance, "transceiver": portable(transceiver), "run_dir": str(run_dir)}
    if role == "context":
        args["request_key"] = RequestKey.new().hex
    return ExecutorConfig(rank_hook=HOOK, rank_hook_args=args, **executor_kw)


def disagg_params(ex, request_id: int, endpoints: tuple[str, ...]) -> DisaggParams:
    """The DisaggParams of context request `request_id` of `ex` (an Executor started from
    hooked_executor_config): its wire handle and secret, derived from the executor's RequestKey."""
    args = ex.cfg.rank_hook_args
    key = _request_key(args)
    return DisaggParams(key.handle(request_id), args["instance"], tuple(endpoints), ex.layout,
                        key.secret(request_id))


def context_request_of(ex, params: DisaggParams, candidates) -> int | None:
    """The executor request id among `candidates` whose wire handle and secret are those of `params` (the
    DisaggParams `disagg_params` made for it); None when none matches. The secret is compared in constant time."""
    key = _request_key(ex.cfg.rank_hook_args)
    for rid in candidates:
        if key.handle(rid) == params.ctx_request_id and hmac.compare_digest(key.secret(rid), params.secret):
            return rid
    return None


def _request_key(args: dict) -> RequestKey:
    try:
        return RequestKey.from_hex(args.get("request_key"), "rank_hook_args['request_key']")
    except ConfigError as e:
        raise ExecutorError(f"transceiver hook (context): {e}; hooked_executor_config makes one") from None


@dataclass
class _Req:
    request_id: int
    block_ids: Any
    num_tokens: int
    disagg_params: Any = None
    from_token: int = 0  # prefix reuse: the blocks already hold tokens [0, from_token)
    secret: bytes | None = None
    layers_ready: int | None = None  # context, streaming: local layers readable at publish (None: all)


class TransceiverHook:
    """One rank's CacheTransceiver, driven by the executor's step loop (see executor/hooks.py)."""

    def __init__(self, ctx: RankContext) -> None:
        a = ctx.args
        self.role = a.get("role")
        if self.role not in ("context", "generation"):
            raise ExecutorError(f"transceiver hook: role must be 'context' or 'generation', got {self.role!r}")
        cfg = TransceiverConfig.from_dict(a.get("transceiver"))
        if cfg.port:  # one port per rank: base + rank
            cfg = cfg.with_(port=cfg.port + ctx.rank)
        make = CacheTransceiver.context if self.role == "context" else CacheTransceiver.generation
        self.tr = make(ctx.pool, ctx.layout, ctx.rank, ctx.kv.num_blocks, cfg, instance=a.get("instance"))
        self.rank = ctx.rank
        self._failed: list[tuple[int, str]] = []
        self._key = _request_key(a) if self.role == "context" else None
        self._rid_of: dict[int, int] = {}  # context: wire handle -> executor request id
        self._streamed: set[int] = set()  # context: handles published at admission (layer-wise streaming)
        if self.role == "context" and a.get("run_dir"):
            path = os.path.join(a["run_dir"], f"endpoint-{ctx.rank}")
            with open(path + ".tmp", "w") as f:
                f.write(self.tr.endpoint)
            os.replace(path + ".tmp", path)

    def on_context_start(self, request_id: int, block_ids, num_tokens: int) -> None:
        """Layer-wise streaming: the prefill is about to run on these blocks; publish it with no layer
        readable (generation ranks may fetch it now and read each layer group once marked ready)."""
        handle = self._key.handle(request_id)
        self._rid_of[handle] = request_id
        self._streamed.add(handle)
        self.tr.respond_and_send_async(_Req(handle, np.asarray(block_ids, dtype=np.int64), num_tokens,
                                            secret=self._key.secret(request_id), layers_ready=0))

    def on_layers_ready(self, request_id: int, layers: int) -> None:
        """Layer-wise streaming: the first `layers` local layers of the request hold their final KV."""
        self.tr.sender.mark_layers_ready(self._key.handle(request_id), layers)

    def on_context_done(self, request_id: int, block_ids, num_tokens: int, first_token: int | None = None) -> None:
        handle = self._key.handle(request_id)
        if handle in self._streamed:  # published at admission, every layer already marked ready
            self._streamed.discard(handle)
            return
        self._rid_of[handle] = request_id
        self.tr.respond_and_send_async(_Req(handle, np.asarray(block_ids, dtype=np.int64), num_tokens,
                                            secret=self._key.secret(request_id)))

    def on_generation_alloc(self, request_id: int, block_ids, prompt_len: int, ctx_info: dict) -> None:
        params = (ctx_info or {}).get("disagg_params")
        if params is None:
            self._failed.append((request_id, "no disagg_params in ctx_info"))
            return
        try:
            p = params if isinstance(params, DisaggParams) else DisaggParams.from_dict(params)
            self.tr.request_and_receive_async(_Req(request_id, np.asarray(block_ids, dtype=np.int64), prompt_len,
                                                   p, int((ctx_info or {}).get("reused_tokens", 0))))
        except Exception as e:  # noqa: BLE001 - bad params from a client: abort this request, keep serving
            self._failed.append((request_id, f"{type(e).__name__}: {e}"))

    def on_abort(self, request_id: int) -> None:
        """The executor aborted the request: stop moving its KV. Its blocks are freed once every rank reports
        it settled (context: released after readers in flight finish; generation: the pull's failure)."""
        self.tr.cancel_request(self._key.handle(request_id) if self._key is not None else request_id)

    def poll(self) -> dict[str, list]:
        out: dict[str, list] = {"kv_ready": [], "release": [], "abort": [], "notes": [], "stats": []}
        for rid, why in self._failed:
            out["abort"].append(rid)
            out["notes"].append([rid, why])
        self._failed = []
        if self.role == "context":
            for r in self.tr.check_context_transfer_status():
                rid = self._rid_of.pop(r.ctx_request_id, None)
                if rid is None:
                    continue
                out["release"].append(rid)
                if r.status != "complete":
                    log.info("context request %d finished on rank %d as %s: %s", rid, self.rank, r.status, r.detail)
        else:
            for r in self.tr.check_gen_transfer_status():
                if r.ok:
                    out["kv_ready"].append(r.request_id)
                    out["stats"].append([r.request_id, transfer_stats(r)])
                else:
                    out["abort"].append(r.request_id)
                    out["notes"].append([r.request_id, f"KV transfer failed ({r.error_type}): {r.error}"])
        return out

    def close(self) -> None:
        self.tr.close()


def make(ctx: RankContext) -> TransceiverHook:
    return TransceiverHook(ctx)


def context_endpoints(run_dir: str, world_size: int, timeout: float = 60.0) -> tuple[str, ...]:
    """The control endpoints the context ranks wrote to run_dir, in rank order (waits up to `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        paths = [os.path.join(run_dir, f"endpoint-{r}") for r in range(world_size)]
        if all(os.path.exists(p) for p in paths):
            return tuple(open(p).read().strip() for p in paths)
        if time.monotonic() > deadline:
            missing = [p for p in paths if not os.path.exists(p)]
            raise ExecutorError(f"context ranks did not publish their endpoints within {timeout:g} s: {missing}")
        time.sleep(0.05)
