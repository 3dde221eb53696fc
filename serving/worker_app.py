"""A worker's HTTP server: one Executor (its rank processes, the transceiver in each) behind FastAPI.

Routes:
    POST /v1/completions, /v1/chat/completions   OpenAI requests; with disaggregated_params
        {"request_type": "context_only"}    (context worker) prefill, answer the first token and
                                            disaggregated_params for the generation side (DisaggParams inside)
        {"request_type": "generation_only", ...}  (generation worker) pull the KV, decode, answer / stream
        none                                aggregated on this worker's executor (either role)
    GET /health (503 once the executor failed, while draining, or `stalled`: its ranks answered no probe for
        half of hang_timeout_s, worker_state.watch_ranks), /metrics (Prometheus, every rank process merged),
        /v1/models, /debug/free_blocks (free blocks per rank, pinned context requests)
    POST /internal/release {"disaggregated_params": <what this context worker answered>}   (router only)
        drop a prefilled request's KV now (the generation side refused it); readers in flight finish first
    GET /internal/kv_digests?handle=H   the positional KV digest of disaggregated request H (`kvbridge.handle`
        of the generation worker's answer; executor.kv_digests: true, else 409): worker_state.kv_digest_answer

Requests are admitted under the process's bound (max_inflight_requests, max_inflight_body_bytes: beyond it
503 + Retry-After). Anything a request triggers here fails that request alone, as a JSON error.

Every route needs the deployment's internal token (auth.InternalAuth: 401 before any work); /health answers
without it too, but then only {"status": ...} (no name, instance, endpoint, pid or load).

Owns request handling, the token-level parameters' path to the executor (the context and the generation side
build the same SamplingParams, so disaggregated == aggregated tokens), stop strings (at the worker that
produces the text: a match aborts the request, freeing its blocks), logprobs in OpenAI's shapes, and the
generation side's failure policy (`on_transfer_failure`: fail returns the
transfer's error; recompute prefills the prompt here, aggregated). Never frees KV itself (backend.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..errors import KvBridgeError
from ..executor.sampling import SamplingParams
from ..executor.transceiver_hook import disagg_params
from ..transceiver import DisaggParams
from .auth import InternalAuth, authenticated, internal_token
from .inflight import Admission
from .metrics import WorkerMetrics, render
from .context_side import (_context, _kv_bytes_per_token, _prompt_ids,  # noqa: F401
                           _sampling)
from .overlap_router import HANDOVER_HEADER
from .overlap_worker import claim, context_early, join, prefetch, release_prefetch, timing_extra
from .protocol import (DEADLINE_HEADER, SSE_DONE, ApiError, DisaggRequest, GenRequest, add_common_routes, chunk,
                       logprobs_object, new_id, parse_request, read_json, response, sse, usage_chunk)
from .stops import TextCutter
from .worker_state import (WorkerState, housekeeping, internal_error, kv_digest_answer, release_context,
                           watch_ranks)

log = logging.getLogger("kvbridge.serving.worker")

__all__ = ["WorkerState", "build_app"]


def build_app(st: WorkerState, on_fatal=lambda: None) -> FastAPI:
    """The worker's FastAPI application over a started executor.

    Args:
        st: the worker's state (its executor already started).
        on_fatal: called once if the executor fails while serving (the worker should stop).
    """
    return WorkerApp(st, on_fatal).app


class WorkerApp:
    """One worker's routes over its WorkerState; admission and in-flight counts by one context manager
    (`_in_flight`), whose `end` runs exactly once per request."""

    def __init__(self, st: WorkerState, on_fatal) -> None:
        self.st, self.on_fatal = st, on_fatal
        self.metrics = WorkerMetrics(st.spec.role)
        self.admission = Admission(st.cfg.max_inflight_requests, st.cfg.max_inflight_body_bytes)
        self.app = self._build()

    def _build(self) -> FastAPI:
        st, spec = self.st, self.st.spec

        @contextlib.asynccontextmanager
        async def lifespan(_app: FastAPI):
            tasks = [asyncio.create_task(housekeeping(st, self.on_fatal))]
            if st.cfg.hang_timeout_s:
                tasks.append(asyncio.create_task(watch_ranks(st)))
            try:
                yield
            finally:
                for task in tasks:
                    task.cancel()

        app = FastAPI(title=f"kvbridge worker {spec.name}", docs_url=None, redoc_url=None, lifespan=lifespan)
        app.add_middleware(InternalAuth, token=internal_token(st.cfg))

        @app.exception_handler(ApiError)
        async def _api_error(_req: Request, e: ApiError) -> JSONResponse:
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers())

        @app.exception_handler(Exception)
        async def _unexpected(_req: Request, e: Exception) -> JSONResponse:
            return JSONResponse(internal_error(spec.name, e).body(), status_code=500)

        app.get("/health")(self.health)
        add_common_routes(app, st.cfg.model_name, st.started, render)
        app.get("/debug/free_blocks")(self.free_blocks)
        app.post("/internal/release")(self.release)
        app.post("/internal/prefetch")(self.prefetch)
        app.post("/internal/join")(self.join)
        app.get("/internal/kv_digests")(self.kv_digests)

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self.handle(request, "completion")

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await self.handle(request, "chat")

        return app

    async def health(self, request: Request) -> JSONResponse:
        st, be = self.st, self.st.backend
        err, silent = st.failed or be.ex.error, st.executor_silence()
        status = "failed" if err else "stalled" if silent else "draining" if st.draining else "ok"
        code = 200 if status == "ok" else 503
        if not authenticated(request):  # nothing an attacker can use: no endpoint, instance, id or load
            return JSONResponse({"status": status}, status_code=code)
        body = {"status": status, "name": st.spec.name, "role": st.spec.role,
                "model": st.cfg.model_name, "instance": st.instance, "tp": st.spec.tp, "pp": st.spec.pp,
                "in_flight": be.in_flight, "pinned_context_requests": len(be.pinned), "pid": os.getpid(),
                "capacity_tokens": be.ex.cfg.num_blocks * be.ex.cfg.tokens_per_block,
                "device": be.ex.cfg.device, "layout": be.ex.layout.to_wire()}
        if st.kv_events:
            body["kv_events"] = st.kv_events
        if err:
            body["error"] = err.splitlines()[0]
        elif silent:
            body["executor_silent_s"] = round(silent, 1)
            body["error"] = f"its executor's ranks answered no probe for {silent:.0f}s"
        return JSONResponse(body, status_code=code)

    async def free_blocks(self) -> dict:
        be = self.st.backend
        free = await be.free_blocks()
        return {"free_blocks": free, "num_blocks": be.ex.cfg.num_blocks, "pinned_context_requests":
                be.collect_released() if self.st.spec.role == "context" else 0}

    async def release(self, request: Request) -> JSONResponse:
        body = await read_json(request)
        d = body.get("disaggregated_params") if isinstance(body, dict) else None
        if self.st.spec.role == "generation":  # a prefetch (overlap_worker.py)
            return JSONResponse({"released": release_prefetch(self.st, d)})
        return JSONResponse({"released": release_context(self.st, d)})

    async def prefetch(self, request: Request) -> JSONResponse:
        deadline = time.monotonic() + _timeout(request, self.st.cfg.router.request_timeout_s)
        return JSONResponse(await prefetch(self.st, await read_json(request), deadline))

    async def join(self, request: Request) -> JSONResponse:
        return JSONResponse({"joined": join(self.st, await read_json(request))})

    async def kv_digests(self, handle: str | None = None) -> dict:
        return await kv_digest_answer(self.st, handle)

    @contextlib.contextmanager
    def _in_flight(self, kind: str):
        """Admission and the in-flight counts of one request; `end(outcome)` closes them once (a stream calls
        it when its generator finishes, anything else when the handler returns)."""
        t0, be, metrics = time.monotonic(), self.st.backend, self.metrics
        slot = contextlib.ExitStack()
        ticket = slot.enter_context(self.admission.request())
        be.in_flight += 1
        metrics.in_flight.inc()
        phase, open_ = {"phase": "generate"}, [True]

        def end(result: str) -> None:
            if not open_:
                return
            open_.clear()
            be.in_flight -= 1
            metrics.in_flight.dec()
            slot.close()
            dt = time.monotonic() - t0
            metrics.done(kind, result, dt, phase["phase"], dt)

        yield t0, ticket, phase, end

    async def handle(self, request: Request, kind: str):
        st, cfg = self.st, self.st.cfg
        outcome, streaming = "ok", False
        with self._in_flight(kind) as (t0, ticket, phase, end):
            try:
                req = parse_request(await read_json(request, ticket), kind, cfg.default_max_tokens)
                if req.model and req.model not in (cfg.model_name, cfg.model):
                    raise ApiError(404, f"model {req.model!r} is not served here; this server has "
                                        f"{cfg.model_name!r}", code="model_not_found", param="model")
                deadline = t0 + _timeout(request, cfg.router.request_timeout_s)
                if req.disagg is not None and req.disagg.request_type == "context_only":
                    phase["phase"] = "prefill"
                    if request.headers.get(HANDOVER_HEADER) == "early":  # overlap (overlap_worker.py)
                        streaming = True
                        return await context_early(st, req, deadline, end)
                    return await _context(st, req, deadline)
                resp = await _generate(st, request, req, deadline, self.metrics, end)
                streaming = isinstance(resp, StreamingResponse)
                return resp
            except ApiError as e:
                outcome = e.code or e.type
                raise
            except Exception as e:  # noqa: BLE001 - fails this request alone (JSON), never the worker
                outcome = "internal_error"
                raise internal_error(st.spec.name, e) from None
            finally:
                if not streaming:
                    end(outcome)


# --- the two halves -------------------------------------------------------------------------------------
async def _generate(st: WorkerState, request: Request, req: GenRequest, deadline: float,
                    metrics: WorkerMetrics, end):
    spec, be, cfg = st.spec, st.backend, st.cfg
    d = req.disagg
    extra: dict[str, Any] = {"generation_worker": spec.name}
    if d is not None:  # generation_only
        prompt, extra["handle"] = _generation_only(st, req)
        seed = d.seed if d.seed is not None else req.seed or 0
        extra["context_worker"] = d.context_worker
    else:
        prompt, seed = _prompt_ids(st, req), (secrets.randbits(31) if req.seed is None else req.seed)
    sampling = _sampling(st, req, seed)
    gone = None if req.stream else request.is_disconnected
    follow = req.stream or bool(req.stop)  # stop strings are looked for as the tokens arrive

    def submit(aggregated: bool) -> int:
        try:
            if aggregated:
                return be.ex.submit(prompt, max_tokens=req.max_tokens, sampling=sampling, stream=follow)
            rid = claim(st, d, prompt, req.max_tokens, sampling)  # prefetched while the prefill ran
            if rid is None:
                rid = be.ex.submit(prompt, max_tokens=req.max_tokens, mode="generation_only",
                                   sampling=sampling, first_token=d.first_token,
                                   ctx_info={"disagg_params": d.ctx_params}, stream=follow)
            st.record_handle(extra["handle"], rid)
            return rid
        except KvBridgeError as e:
            raise be.error(e, "submit") from None

    events = be.follow(submit(d is None), deadline, gone)
    got = await anext(events)
    first_lp = d.first_logprob if d is not None else None  # the context side sampled the first token
    if got.done is not None and got.done.finish_reason == "aborted" and d is not None and not got.tokens:
        reason = got.done.error or "the KV transfer was aborted"
        if cfg.on_transfer_failure != "recompute":
            src = d.context_worker or "the context worker"
            raise ApiError(502, f"KV transfer from {src} failed: {reason}", "server_error",
                           "kv_transfer_failed")
        log.warning("%s: KV transfer failed (%s); recomputing the prompt here", spec.name, reason)
        metrics.recomputes.inc()
        extra.update(recomputed=True, transfer_error=reason)
        events, first_lp = be.follow(submit(True), deadline, gone), None
        got = await anext(events)
    if got.done is not None and got.done.finish_reason == "aborted":
        raise ApiError(500, f"the request was aborted: {got.done.error or 'no reason given'}", "server_error",
                       "aborted")
    extra.setdefault("recomputed", False)
    out = _Output(st, req, rid=new_id(req.kind), prompt_len=len(prompt), first_lp=first_lp)
    if req.stream:
        return StreamingResponse(_stream(out, got, events, extra, metrics, end),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    got, piece, text = await _whole(st, req, got, events)
    toks, finish = out.cut(got, piece)
    _finish_extra(extra, toks, got.done, metrics)
    _prefix_metrics(st, extra, len(prompt), got.done, metrics)
    return response(out.rid, req, cfg.model_name, text, finish, len(prompt), len(toks), extra,
                    out.logprobs(toks, got, 0, 0))


def _generation_only(st: WorkerState, req: GenRequest) -> tuple[list[int], int]:
    """Check a generation_only request's disaggregated_params; returns its prompt's token ids and its wire
    handle (not a secret: answered in `kvbridge.handle`, the name of its KV digests)."""
    d = req.disagg
    if st.spec.role != "generation":
        raise ApiError(400, f"{st.spec.name} is a context worker; send generation_only requests to a "
                            f"generation worker", code="wrong_role", param="disaggregated_params")
    try:
        handle = DisaggParams.from_dict(d.ctx_params).ctx_request_id
    except KvBridgeError as e:
        raise ApiError(400, f"disaggregated_params.ctx_params: {e}", code="invalid_disaggregated_params",
                       param="disaggregated_params") from None
    if req.logprobs >= 0 and d.first_logprob is None:
        raise ApiError(400, "disaggregated_params.first_logprob: missing, and the request asks for "
                            "logprobs (the context worker samples the first token)",
                       param="disaggregated_params")
    return d.prompt_token_ids, handle


async def _whole(st: WorkerState, req: GenRequest, got, events):
    """A non-streamed request to its end, or to its first stop string (then it is aborted: blocks freed).
    Returns (its last Progress, the cutter's last Piece, the answer's text)."""
    cutter = TextCutter(st.codec, req.stop, req.min_tokens)
    try:
        while True:
            piece = cutter.update(got.tokens, final=got.done is not None)
            if piece.stopped_at is not None or got.done is not None:
                return got, piece, cutter.sent
            got = await anext(events)
    finally:
        await events.aclose()


@dataclass
class _Output:
    """What one request's answer is built from: its id, and the logprobs of its tokens (the first one's from
    the context worker when disaggregated)."""

    st: WorkerState
    req: GenRequest
    rid: str
    prompt_len: int
    first_lp: Any = None

    def cut(self, got, piece) -> tuple[list[int], str]:
        """The tokens answered and the finish reason ("stop" when a stop string matched)."""
        if piece.stopped_at is not None:
            return list(got.tokens[:piece.stopped_at]), "stop"
        return list(got.tokens), got.done.finish_reason

    def logprobs(self, toks: list[int], got, start: int, offset: int) -> dict[str, Any] | None:
        """OpenAI logprobs of toks[start:] (None when not asked for); offset: characters before them."""
        if self.req.logprobs < 0:
            return None
        entries = ([self.first_lp] if self.first_lp is not None else []) + list(got.logprobs)
        return logprobs_object(self.req.kind, toks[start:], entries[start:len(toks)], self._piece, offset)

    def _piece(self, token: int) -> tuple[str, list[int]]:
        """A token's text and bytes for logprobs; a raw byte that is no character alone reads "bytes:\\xNN"
        (as vLLM writes it), so distinct tokens keep distinct texts."""
        codec = self.st.codec
        if not codec.has_tokenizer and 0 <= token < 256:
            try:
                return bytes([token]).decode("utf-8"), [token]
            except UnicodeDecodeError:
                return f"bytes:\\x{token:02x}", [token]
        text = codec.decode([token])
        return text, list(text.encode("utf-8"))


async def _stream(out: _Output, got, events, extra: dict[str, Any], metrics: WorkerMetrics, end):
    """The SSE body; `end(outcome)` is called once it finished, failed, or its client went away."""
    st, req, rid = out.st, out.req, out.rid
    cutter = TextCutter(st.codec, req.stop, req.min_tokens)
    sent, first, model, offset = 0, True, st.cfg.model_name, 0
    outcome = "client_closed"
    try:
        while True:
            piece = cutter.update(got.tokens, final=got.done is not None)
            if piece.stopped_at is not None or got.done is not None:
                toks, finish = out.cut(got, piece)
                _finish_extra(extra, toks, got.done, metrics)
                _prefix_metrics(st, extra, out.prompt_len, got.done, metrics)
                last = {**extra, "token_ids": toks[sent:]}
                yield sse(chunk(rid, req, model, piece.text, finish, last, first,
                                out.logprobs(toks, got, sent, offset)))
                if req.include_usage:
                    yield sse(usage_chunk(rid, req, model, out.prompt_len, len(toks)))
                yield SSE_DONE
                outcome = "ok"
                return
            new = got.tokens[sent:]
            if new:
                lps = out.logprobs(got.tokens, got, sent, offset)
                yield sse(chunk(rid, req, model, piece.text, None, {"token_ids": new}, first, lps))
                first, sent = False, len(got.tokens)
                offset += sum(len(x) for x in lps["tokens"]) if lps and req.kind != "chat" else 0
            got = await anext(events)
    except ApiError as e:
        outcome = e.code or e.type
        yield sse(e.body())
    finally:
        await events.aclose()
        end(outcome)


def _finish_extra(extra: dict[str, Any], toks: list[int], done, metrics: WorkerMetrics) -> None:
    extra["token_ids"] = list(toks)
    timing_extra(extra, done)
    if done is not None and done.transfer is not None:
        extra["transfer"] = done.transfer.as_json()
        metrics.transfer_done(done.transfer)


def _prefix_metrics(st: WorkerState, extra: dict[str, Any], prompt_len: int, done,
                    metrics: WorkerMetrics) -> None:
    """Block reuse: how many prompt tokens the prefix cache served (in the response and /metrics)."""
    if done is None:  # ended by a stop string before the executor's own end: reported with the abort
        return
    extra["reused_tokens"] = done.reused_tokens
    metrics.prefix(prompt_len, done.reused_tokens, _kv_bytes_per_token(st.backend.ex.layout))


def _timeout(request: Request, default: float) -> float:
    v = request.headers.get(DEADLINE_HEADER)
    try:
        return min(default, max(0.0, float(v))) if v else default
    except ValueError:
        raise ApiError(400, f"header {DEADLINE_HEADER}: {v!r} is not a number of seconds") from None
