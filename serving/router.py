"""The OpenAI-compatible front door of a disaggregated deployment (`kvbridge router`: router_cli.py).

Each request is validated once here, before any hop (validate.py, fanout.py, protocol.parse_request), and
admitted under the process's bound (inflight.Admission: beyond it 503 + Retry-After). A healthy generation
worker is picked first (none: 503, nothing prefilled); then a context worker (marked context_only: it
prefills and answers the first token and the disaggregation parameters); then the generation worker with
those parameters (it pulls the KV, decodes and answers or streams). `n` > 1 and a list of prompts fan out
into one such run per choice (fanout.py). Routes: /v1/completions, /v1/chat/completions (both streaming by
server-sent events or not), /v1/models, /health, /metrics.

Deadlines on every hop: the whole request (router.request_timeout_s, streaming included), each context hop
(context_timeout_s), and connection set-up (connect_timeout_s); the remaining time travels to the worker in
the x-kvbridge-timeout-s header. A context worker that fails before handing over (connection refused, reset,
5xx, no answer in time) is retried on another. A KV pull that fails after handover (the context worker died,
its lease expired, the transfer failed) runs the request again from another context worker, at most
MAX_HANDOVERS times within the deadline (so does a generation worker that cannot be connected to, or whose
connection breaks before it answers, e.g. one leaving or dying: the next pick skips it). Whenever a
generation hop fails after a prefill, the context worker is told to drop that KV at once (POST
/internal/release). A client that goes away, or a deadline that
passes, closes the generation worker's connection, and the generation worker aborts its request. Every
failure reaches the client as an OpenAI error object, never as HTTP 200 with garbage; once a stream has
started, as a final `data: {"error": ...}` event without `[DONE]`. In-flight counts are kept by one context
manager each (inflight.py). Never touches KV or a model itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .auth import api_keys, install_api_keys, internal_headers, key_ok
from .balancer import WorkerRef, routing_key
from .config import ServeConfig
from .engines import engine_backend
from .fanout import Part, expand, merge, merge_streams
from .health import HealthRule, probe
from .inflight import Admission, in_flight
from .kv_policy import KvRouting, shown
from .membership import worker_set
from .metrics import RouterMetrics, render
from .overlap_router import ContextFailed, context_early, release_prefetch
from .protocol import DEADLINE_HEADER, ApiError, add_common_routes, read_json
from .relay import (RERUN_CODES, Relay, context_send, decorate, decoration, events, from_worker, json_or_none,
                    read_body, sse_body)
from .tls import client_verify

__all__ = ["KEEPALIVE_EXPIRY_S", "MAX_HANDOVERS", "Router", "build_router"]

log = logging.getLogger("kvbridge.serving.router")

MAX_HANDOVERS = 3          # runs of one choice after a KV pull failed (each from another context worker)
KEEPALIVE_EXPIRY_S = 2.0   # below uvicorn's timeout_keep_alive (5 s): never reuse a connection it closes


def build_router(cfg: ServeConfig) -> FastAPI:
    """The router's FastAPI application for a ServeConfig."""
    return Router(cfg).app


def make_client(cfg: ServeConfig) -> httpx.AsyncClient:
    """The one HTTP client to the workers (pool sized for many streams; idle connections dropped before
    the worker's server would close them)."""
    return httpx.AsyncClient(limits=httpx.Limits(max_connections=2048, max_keepalive_connections=256,
                                                 keepalive_expiry=KEEPALIVE_EXPIRY_S),
                             headers=internal_headers(cfg),  # the deployment's token on every worker call
                             verify=client_verify(cfg.tls))  # with tls: the workers' certificates, by the CA


class Router:
    """The router of one ServeConfig: worker pools, the HTTP client, the application (`app`)."""

    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg, self.rc = cfg, cfg.router
        self.members = worker_set(cfg)  # the config's urls, or a disagg_cluster's live membership
        self.ctx, self.gen = self.members.pool("context"), self.members.pool("generation")
        self.metrics = RouterMetrics()
        self.admission = Admission(cfg.max_inflight_requests, cfg.max_inflight_body_bytes)
        self.client = make_client(cfg)
        self.engine = engine_backend(self)  # None: kvbridge workers; else the engine's own hops
        self._health = HealthRule(self.rc.health_failures)
        self._codec = None
        self.kv = KvRouting(cfg) if self.rc.policy == "kv_aware" else None  # by the workers' KV events
        self.app = self._build_app()

    # --- application ----------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(_app):
            task = asyncio.create_task(self._health_loop())
            await self.members.start(self._check, self._gone)  # a worker that joins is checked at once
            try:
                yield
            finally:
                task.cancel()
                await self.members.stop()
                await self.client.aclose()
                if self.kv is not None:
                    self.kv.close()

        app = FastAPI(title="kvbridge router", docs_url=None, redoc_url=None, lifespan=lifespan)
        install_api_keys(app, self.cfg, api_keys(self.cfg))  # /v1/*, /metrics: a key when any is set
        app.add_exception_handler(ApiError, _api_error)
        app.add_exception_handler(Exception, _unexpected)
        app.get("/health")(self.health)
        self.members.install(app)
        add_common_routes(app, self.cfg.model_name, time.time(), render)

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self.handle(request, "/v1/completions", "completions")

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await self.handle(request, "/v1/chat/completions", "chat")

        app.state.pools = (self.ctx, self.gen)
        return app

    async def health(self, request: Request) -> JSONResponse:
        ok = any(w.healthy for w in self.ctx.workers) and any(w.healthy for w in self.gen.workers)
        if not key_ok(request):  # a probe without the key learns up or down, nothing of the deployment
            return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)
        body = {"status": "ok" if ok else "unavailable", "model": self.cfg.model_name,
                "policy": self.rc.policy,
                "context_workers": {w.name: w.healthy for w in self.ctx.workers},
                "generation_workers": {w.name: w.healthy for w in self.gen.workers}}
        if self.members.mode != "static":
            body["cluster"] = self.members.describe()
        return JSONResponse(body, status_code=200 if ok else 503)

    def _tmo(self, left: float) -> httpx.Timeout:
        return httpx.Timeout(max(0.05, left), connect=min(self.rc.connect_timeout_s, max(0.05, left)))

    async def _check(self, w: WorkerRef) -> None:  # the rule: serving/health.py
        info = await probe(self.client, w, self._tmo(self.rc.health_timeout_s), self._health)
        if w.kv_events is not None and w.healthy:  # a vLLM server: its member relays its events
            info = {**(info or {}), "kv_events": w.kv_events}
        if self.kv is not None:  # (a worker that left while it was probed is not followed again)
            self.kv.on_health(w, info if w in self.members.pool(w.role).workers else None)

    def _gone(self, w: WorkerRef) -> None:
        if self.kv is not None:
            self.kv.forget(w)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._check(w) for w in [*self.ctx.workers, *self.gen.workers]))
            await asyncio.sleep(self.rc.health_interval_s)

    # --- one request ----------------------------------------------------------------------------------
    async def handle(self, request: Request, path: str, endpoint: str):
        """Admit, validate, run every part; the admission slot is held until the response (or stream) ends."""
        deadline = time.monotonic() + self.rc.request_timeout_s
        status, stack = 200, contextlib.ExitStack()
        try:
            ticket = stack.enter_context(self.admission.request())
            self.members.admit()  # disagg_cluster: 503 + Retry-After below minimal_instances
            body = await read_json(request, ticket)
            kind = "chat" if endpoint == "chat" else "completion"
            parts = self._parts(body, kind)
            if body.get("stream", False) is True:
                resp = await self._stream(request, path, parts, deadline, stack)
                stack = contextlib.ExitStack()  # the stream owns the slot now
                return resp
            objs = await _all(self.run_part(request, path, p.body, False, deadline) for p in parts)
            return JSONResponse(merge(objs, parts))
        except ApiError as e:
            status = e.status
            raise
        except Exception as e:  # noqa: BLE001 - fails this request alone, as JSON (the connection stays)
            status = 500
            raise _internal(e) from None
        finally:
            stack.close()
            self.metrics.requests.labels(endpoint, str(status)).inc()

    def _parts(self, body: Any, kind: str) -> list[Part]:
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        if body.get("model") not in (None, self.cfg.model_name, self.cfg.model):
            raise ApiError(404, f"model {body['model']!r:.100} is not served here; this deployment serves "
                                f"{self.cfg.model_name!r}", code="model_not_found", param="model")
        if self.engine is not None:
            return self.engine.parts(body, kind)
        if "disaggregated_params" in body:
            raise ApiError(400, "disaggregated_params is set by the router, not by clients",
                           param="disaggregated_params")
        return expand(body, kind, self.cfg.default_max_tokens, self._decode)

    def _decode(self, ids: list[int]) -> str:
        if self._codec is None:
            from .text import TextCodec

            self._codec = TextCodec(self.cfg.model)
        return self._codec.decode(ids)

    async def _stream(self, request: Request, path: str, parts: list[Part], deadline: float,
                      slot: contextlib.ExitStack) -> StreamingResponse:
        """Open every part's stream (an error before the first byte is a real HTTP error), then relay."""
        opened = await asyncio.gather(*(self.run_part(request, path, p.body, True, deadline) for p in parts),
                                      return_exceptions=True)
        bad = next((o for o in opened if isinstance(o, BaseException)), None)
        if bad is not None:
            await asyncio.gather(*(o.aclose() for o in opened if not isinstance(o, BaseException)))
            raise bad
        events = opened[0] if len(parts) == 1 else merge_streams(list(opened), parts)
        if len(parts) == 1 and parts[0].echo is not None:
            events = merge_streams([events], parts)
        body = sse_body(events, slot)
        first = await body.__anext__()  # started: its `finally` now runs however the response ends

        async def relay():
            yield first
            async for piece in body:
                yield piece

        return StreamingResponse(relay(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def run_part(self, request: Request, path: str, body: dict, stream: bool, deadline: float):
        """One choice: capacity check, context hop, generation hop; a failed KV pull runs it again from
        another context worker. Returns the answer (dict) or, streaming, an iterator of event objects."""
        if self.engine is not None:
            return await self.engine.run_part(request, path, body, stream, deadline)
        avoid: set[str] = set()
        route: dict | None = {"policy": "kv_aware"} if self.kv is not None else None
        for attempt in range(MAX_HANDOVERS):
            gen_w = self._pick_generation(body, route)
            if route is not None and self.kv.local_prefill(route):  # a short tail: no context hop at all
                return await self._generation_hop(request, path, body, stream, deadline, gen_w, shown(route))
            ctx_data, ctx_w = await self._context_hop(request, path, body, deadline, avoid, gen_w, route)
            gen_body = {**body, "disaggregated_params": ctx_data["disaggregated_params"]}
            deco = {**decoration(ctx_data, ctx_w), **(shown(route) if route is not None else {})}
            try:
                return await self._generation_hop(request, path, gen_body, stream, deadline, gen_w, deco)
            except ApiError as e:
                await self._release(ctx_w, ctx_data)
                if (ctx_data.get("kvbridge") or {}).get("overlap"):  # its prefetch, if not claimed
                    await release_prefetch(self, gen_w, ctx_data["disaggregated_params"])
                last = attempt == MAX_HANDOVERS - 1 or time.monotonic() >= deadline
                if e.code not in RERUN_CODES or last:
                    raise
                log.warning("router: %s after the prefill on %s (%s); running the choice again", e.code,
                            ctx_w.name, e.message)
                if e.code == "kv_transfer_failed":  # the context worker's side failed: prefer another
                    avoid.add(ctx_w.name)
                self.metrics.retries.inc()
        raise AssertionError("unreachable")  # the loop returns or raises

    def _pick_generation(self, body: dict, route: dict | None = None) -> WorkerRef:
        """A healthy generation worker whose pool can hold what is known of the request before the prefill
        (max_tokens, and a token-id prompt's length); 503 when none is healthy, 400 when it cannot fit."""
        if route is not None:  # kv_aware: `route` collects the decisions (kvbridge.route of the answer)
            route["tokens"] = self.kv.tokens(body)
            w, route["generation"] = self.kv.pick(self.gen, "generation", route["tokens"], healthy_only=True,
                                                  context=self.ctx)
        else:
            w = self.gen.pick(key=routing_key(body), healthy_only=True)
        if w is None:
            raise ApiError(503, f"no generation worker is healthy ({self.gen.describe()}); nothing was "
                                f"prefilled", "server_error", "no_generation_worker", retry_after=2)
        mt = body.get("max_completion_tokens", body.get("max_tokens")) or self.cfg.default_max_tokens
        prompt = body.get("prompt")
        need = mt + (len(prompt) if isinstance(prompt, list) else 1)
        if w.capacity_tokens is not None and need > w.capacity_tokens:
            raise ApiError(400, f"max_tokens: the request needs at least {need} tokens of KV; generation "
                                f"worker {w.name} holds {w.capacity_tokens}", code="context_length_exceeded",
                           param="max_tokens")
        return w

    # --- hops -----------------------------------------------------------------------------------------
    async def _context_hop(self, request: Request, path: str, body: dict, deadline: float,
                           avoid: set[str], gen_w: WorkerRef, route: dict | None = None
                           ) -> tuple[dict, WorkerRef]:
        """Prefill on a context worker (one not in `avoid` if any is left); retried on another on failure.
        With router.overlap, `gen_w` is told of the request as its prefill starts (overlap_router.py)."""
        tried: set[str] = set()
        errors: list[str] = []
        while True:
            key = routing_key(body)
            if route is not None:
                for ex in (tried | avoid, tried):
                    w, route["context"] = self.kv.pick(self.ctx, "context", route.get("tokens"), ex)
                    if w is not None:
                        break
            else:
                w = self.ctx.pick(tried | avoid, key) or self.ctx.pick(tried, key)
            left = deadline - time.monotonic()
            if w is None or left <= 0:
                raise _no_context(errors, self.ctx.describe(), left <= 0)
            if tried:
                self.metrics.retries.inc()
            tried.add(w.name)
            hop = min(left, self.rc.context_timeout_s)
            try:
                if self.rc.overlap:
                    status, data = await context_early(self, request, w, path, body, hop, gen_w)
                else:
                    r = await self._post_context(request, w, path, body, hop)
                    status, data = r.status_code, json_or_none(r.content)
            except (_HopFailed, ContextFailed) as e:
                errors.append(str(e))
                continue
            finally:
                if route is not None:
                    self.kv.settle(w, route.get("context"))
            handed_over = isinstance(data, dict) and isinstance(data.get("disaggregated_params"), dict)
            if status == 200 and handed_over:
                return data, w
            if 400 <= status < 500 and status != 429:
                raise ApiError.from_body(status, data, f"context worker {w.name}: ")
            if status == 503:
                w.mark(False, "503")
            errors.append(f"{w.name}: {ApiError.from_body(status, data).message}")

    async def _post_context(self, request: Request, w: WorkerRef, path: str, body: dict,
                            hop: float) -> httpx.Response:
        """One context request; a connection the worker closed under us is retried once, fresh."""
        payload = {**body, "disaggregated_params": {"request_type": "context_only"}}
        t0 = time.monotonic()

        async def send() -> httpx.Response:
            with in_flight(w, self.metrics.in_flight.labels(w.name)):
                return await self.client.post(w.url + path, json=payload, headers={DEADLINE_HEADER: f"{hop:.3f}"},
                                              timeout=self._tmo(hop))

        r = await context_send(request, w, hop, send, _HopFailed)
        self.metrics.hop.labels("context").observe(time.monotonic() - t0)
        return r

    async def _generation_hop(self, request: Request, path: str, body: dict, stream: bool, deadline: float,
                              w: WorkerRef, deco: dict):
        left = deadline - time.monotonic()
        if left <= 0:
            raise ApiError(504, "the deadline passed before the generation hop", "timeout_error", "timeout")
        stack = contextlib.AsyncExitStack()
        async with stack:
            stack.enter_context(in_flight(w, self.metrics.in_flight.labels(w.name)))
            t0 = time.monotonic()
            resp = await self._send(request, w, path, body, left)
            stack.push_async_callback(resp.aclose)
            if resp.status_code != 200 or not stream:
                raw = await read_body(request, resp, w, left)
            if resp.status_code != 200:
                raise ApiError.from_body(resp.status_code, json_or_none(raw),
                                         f"generation worker {w.name}: ")
            if stream:
                return Relay(events(resp, w, deadline, deco, self.rc.request_timeout_s), stack.pop_all())
            data = json_or_none(raw)
            if not isinstance(data, dict) or not isinstance(data.get("choices"), list) or not data["choices"]:
                raise ApiError.from_body(502, data, f"generation worker {w.name}: ")
            self.metrics.hop.labels("generation").observe(time.monotonic() - t0)
            return decorate(data, deco)

    async def _send(self, request: Request, w: WorkerRef, path: str, body: dict,
                    left: float) -> httpx.Response:
        hreq = self.client.build_request("POST", w.url + path, json=body, timeout=self._tmo(left),
                                         headers={DEADLINE_HEADER: f"{left:.3f}"})
        return await from_worker(request, self.client.send(hreq, stream=True), w, "generation worker",
                                 f"did not answer within {left:.1f}s", sending=True)

    async def _release(self, w: WorkerRef, ctx_data: dict) -> None:
        """Tell the context worker to drop a prefilled request's KV now (best effort, bounded)."""
        try:
            await self.client.post(w.url + "/internal/release", timeout=self._tmo(2.0),
                                   json={"disaggregated_params": ctx_data["disaggregated_params"]})
        except httpx.HTTPError as e:
            log.warning("router: could not release a prefilled request on %s: %s", w.name, type(e).__name__)


async def _all(coros) -> list:
    """Every result in order; the first failure cancels the rest (nothing keeps running for nobody)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _HopFailed(Exception):
    """A context hop that failed before an answer (the next context worker is tried)."""


def _no_context(errors: list[str], described: str, late: bool) -> ApiError:
    why = "; ".join(errors) or f"context workers: {described}"
    if late:
        return ApiError(504, f"no context worker answered before the deadline ({why})", "timeout_error",
                        "timeout")
    return ApiError(502 if errors else 503, f"no context worker could prefill the prompt: {why}",
                    "server_error", "context_failed", retry_after=None if errors else 2)


async def _api_error(_req: Request, e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers())


def _internal(e: Exception) -> ApiError:
    log.error("router: a request failed unexpectedly", exc_info=e)
    return ApiError(500, f"the router failed this request: {type(e).__name__}: {e}"[:500], "server_error",
                    "internal_error")


async def _unexpected(_req: Request, e: Exception) -> JSONResponse:
    return JSONResponse(_internal(e).body(), status_code=500)
