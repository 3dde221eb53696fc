"""The workers' half of overlap: the generation side learns of a request while its prefill runs.

Without overlap the router sends a request to the generation worker only once the context worker answered,
so the whole KV transfer sits on the critical path. With it (router.overlap, on by default) the router asks
the context worker for an early handover (header x-kvbridge-handover: early) and:

    context worker   submits the prefill, waits (bounded) until the executor admitted it into a step (with
                     stream_layers the request is published then, layers marked ready as the forward writes
                     them), and answers NDJSON: line 1 {"handover": <generation_only disaggregated_params,
                     first_token null>} at once, line 2 the usual context answer (first token, its logprob,
                     prefill timestamps) when the prefill ended, or {"error", "status"} when it failed.
    router           on line 1 posts POST /internal/prefetch to the generation worker it already picked.
    generation       submits the request generation-only WITHOUT its first token (engine.py: overlap): its
                     blocks are allocated and its ranks fetch and read each layer group as the context ranks
                     mark it ready. On line 2 the router posts the first token at once (POST /internal/join:
                     Executor.join; decoding starts as soon as the KV is in too), then sends the usual
                     generation request, which claims the prefetch by handle and secret (`claim`) and follows
                     it (line 2 leaves out the prompt's token ids: the router has them from line 1).

Failure paths: a prefetch nobody claims is aborted at its deadline (the request's, at most the context hop's
bound later) by the housekeeping loop, or at once by POST /internal/release on the generation worker (the
router sends it whenever the context hop fails after the handover or the generation hop fails); a claim
whose prompt or sampling differs from the prefetch aborts the prefetch and runs the request the usual way;
a prefetch whose pull failed ends aborted and the claim sees it as a failed transfer (kv_transfer_failed,
or recompute). The table is bounded (max_inflight_requests; beyond, 503 and the router falls back to the
sequential path). The handle and secret are the same the context answer carries later: they name one
request's KV and grant nothing else (transceiver/handles.py). Never frees KV itself (the executor does).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from fastapi.responses import StreamingResponse

from ..errors import ExecutorError, KvBridgeError, KVCacheExhausted
from ..executor.transceiver_hook import disagg_params
from ..transceiver import DisaggParams
from .overlap_router import NDJSON
from .context_side import _context_answer, _need_context, _prompt_ids, _sampling, _seed
from .prefetches import Prefetched
from .protocol import ApiError, DisaggRequest, parse_disagg, parse_request

log = logging.getLogger("kvbridge.serving.overlap")

__all__ = ["context_early", "prefetch", "join", "claim", "release_prefetch", "timing_extra"]

CLAIM_SLACK_S = 10.0  # a prefetch waits for its claim at most the context hop's bound plus this


# --- context worker ---------------------------------------------------------------------------------------
async def context_early(st, req, deadline: float, end) -> StreamingResponse:
    """A context_only request answered in two NDJSON lines (the module docstring); `end(outcome)` once."""
    be, spec = st.backend, st.spec
    _need_context(spec)
    prompt = _prompt_ids(st, req)
    seed = _seed(req)
    t0 = time.monotonic()
    try:
        rid = be.ex.submit(prompt, max_tokens=1, mode="context_only", sampling=_sampling(st, req, seed),
                           ctx_info={"notify_start": True})
    except KvBridgeError as e:
        raise be.error(e, "prefill") from None
    try:
        started = await be.call(be.ex.wait_started, rid, max(0.1, deadline - time.monotonic()))
    except (ExecutorError, KVCacheExhausted) as e:
        be.abort(rid)  # still queued after the deadline: it never runs (a refused one is gone already)
        raise be.error(e, "prefill") from None
    wire = disagg_params(be.ex, rid, st.endpoints)
    st.record_handle(wire.ctx_request_id, rid)
    handover = DisaggRequest("generation_only", None, prompt, wire.to_dict(), seed, spec.name).to_dict()

    async def lines():
        settled, outcome = False, "client_closed"
        try:
            yield _line({"handover": handover, "prefill_start_unix_ms": round(started * 1e3, 3)})
            try:
                res = await be.call(be.ex.wait_context, rid, max(0.1, deadline - time.monotonic()))
            except (ExecutorError, KVCacheExhausted) as e:
                settled = not str(e).startswith("timed out")  # (a refusal or an abort ended it already)
                err = be.error(e, "prefill")
                outcome = err.code or err.type
                yield _line({**err.body(), "status": err.status})
                return
            settled = True
            be.pin(rid)
            answer = _context_answer(st, req, prompt, seed, res, t0)
            answer["disaggregated_params"].pop("prompt_token_ids")  # the router has them from line 1
            yield _line(answer)
            outcome = "ok"
        finally:
            if not settled:  # the router went away (or the deadline passed) before the prefill ended
                be.abort(rid)
            end(outcome)

    return StreamingResponse(lines(), media_type=NDJSON, headers={"Cache-Control": "no-cache"})


def _line(obj: dict) -> bytes:
    return (json.dumps(obj, separators=(",", ":")) + "\n").encode()


# --- generation worker ------------------------------------------------------------------------------------
async def prefetch(st, body: Any, deadline: float) -> dict[str, Any]:
    """POST /internal/prefetch {"kind": "completion"|"chat", "request": <the generation request, its
    disaggregated_params from the handover (first_token null)>}: submit it without its first token."""
    be, cfg = st.backend, st.cfg
    if st.spec.role != "generation":
        raise ApiError(400, f"{st.spec.name} is a context worker; prefetch on a generation worker",
                       code="wrong_role")
    kind = body.get("kind") if isinstance(body, dict) else None
    inner = body.get("request") if isinstance(body, dict) else None
    if kind not in ("completion", "chat") or not isinstance(inner, dict):
        raise ApiError(400, "prefetch: expected {\"kind\": \"completion\"|\"chat\", \"request\": {...}}")
    d = inner.get("disaggregated_params")
    if not isinstance(d, dict) or d.get("first_token") is not None:
        raise ApiError(400, "prefetch: disaggregated_params must be a handover (first_token null)",
                       param="disaggregated_params")
    # parsed with a placeholder first token (the executor never sees it: it is submitted without one)
    req = parse_request({**inner, "disaggregated_params": {**d, "first_token": 0}}, kind, cfg.default_max_tokens)
    params = _params(req.disagg)
    if len(st.prefetched) >= cfg.max_inflight_requests:
        raise ApiError(503, f"{st.spec.name} holds {len(st.prefetched)} prefetched requests already",
                       "server_error", "overloaded", retry_after=1)
    sampling = _sampling(st, req, _seed_gen(req))
    prompt = list(req.disagg.prompt_token_ids)
    try:
        rid = be.ex.submit(prompt, max_tokens=req.max_tokens, mode="generation_only", sampling=sampling,
                           ctx_info={"disagg_params": req.disagg.ctx_params, "first_token_later": True},
                           stream=True)
    except KvBridgeError as e:
        raise be.error(e, "prefetch") from None
    until = min(deadline, time.monotonic() + cfg.router.context_timeout_s + CLAIM_SLACK_S)
    st.prefetched.add(params.ctx_request_id,
                      Prefetched(rid, params.secret, (tuple(prompt), req.max_tokens, sampling), until))
    st.record_handle(params.ctx_request_id, rid)
    return {"prefetched": True}


def _seed_gen(req) -> int:
    d = req.disagg
    return d.seed if d.seed is not None else req.seed or 0  # as worker_app._generate does


def _params(d: DisaggRequest | None) -> DisaggParams:
    if d is None or d.request_type != "generation_only":
        raise ApiError(400, "disaggregated_params: expected a generation_only handover",
                       param="disaggregated_params")
    try:
        return DisaggParams.from_dict(d.ctx_params)
    except KvBridgeError as e:
        raise ApiError(400, f"disaggregated_params.ctx_params: {e}", code="invalid_disaggregated_params",
                       param="disaggregated_params") from None


def claim(st, d: DisaggRequest, prompt: list[int], max_tokens: int, sampling) -> int | None:
    """The executor id of this request's prefetch, its first token joined; None when there is none (the
    caller submits it the usual way). A prefetch that does not match the request is aborted."""
    if not len(st.prefetched):
        return None
    params = _params(d)
    p = st.prefetched.take(params.ctx_request_id, params.secret)
    if p is None:
        return None
    be = st.backend
    if p.key != (tuple(prompt), max_tokens, sampling) or p.joined not in (None, d.first_token):
        log.warning("%s: a prefetched request does not match its generation request; running it afresh",
                    st.spec.name)
        be.abort(p.rid)
        return None
    if p.joined is not None:  # the router's join came first (the usual order)
        return p.rid
    try:
        be.ex.join(p.rid, int(d.first_token))
    except KvBridgeError as e:
        be.abort(p.rid)
        raise be.error(e, "generation") from None
    return p.rid


def join(st, body: Any) -> bool:
    """POST /internal/join {"ctx_params": <the handover's>, "first_token": t}: the first token of a prefetched
    request, sent by the router the moment the prefill ended, so decoding starts before the generation
    request (which carries the whole prompt again) is even parsed. False when no such prefetch is here."""
    if not isinstance(body, dict) or type(body.get("first_token")) is not int or body["first_token"] < 0:
        raise ApiError(400, "join: expected {\"ctx_params\": {...}, \"first_token\": <token id>}")
    try:
        params = DisaggParams.from_dict(body.get("ctx_params"))
    except KvBridgeError as e:
        raise ApiError(400, f"join: ctx_params: {e}", code="invalid_disaggregated_params") from None
    p = st.prefetched.get(params.ctx_request_id, params.secret)
    if p is None or p.joined is not None:
        return False
    try:
        st.backend.ex.join(p.rid, body["first_token"])
    except KvBridgeError:
        return False  # the executor failed: the generation request reports it
    p.joined = body["first_token"]
    return True


def release_prefetch(st, d: Any) -> bool:
    """POST /internal/release on a generation worker: abort the prefetch named by a handover (or answer)."""
    req = parse_disagg({**d, "first_token": 0} if isinstance(d, dict) and d.get("first_token") is None else d)
    p = st.prefetched.take(_params(req).ctx_request_id, _params(req).secret)
    if p is None:
        return False
    st.backend.abort(p.rid)
    return True


def timing_extra(extra: dict[str, Any], done) -> None:
    """When a generation-only request started decoding (unix ms), for overlap measurements."""
    if done is not None and getattr(done, "decode_at", 0.0):
        extra["decode_start_unix_ms"] = round(done.decode_at * 1e3, 3)
