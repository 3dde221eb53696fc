"""`kvbridge router --config CONFIG`: the OpenAI-compatible front door of a disaggregated deployment.

Each request goes to a context worker (marked context_only: it prefills and answers the first token and
the disaggregation parameters), then to a generation worker with those parameters (it pulls the KV, decodes
and answers or streams). Routes: /v1/completions, /v1/chat/completions (both streaming by server-sent
events or not), /v1/models, /health, /metrics.

Deadlines on every hop: the whole request (router.request_timeout_s, streaming included), each context hop
(context_timeout_s), and connection set-up (connect_timeout_s); the remaining time travels to the worker in
the x-kvbridge-timeout-s header. A context worker that fails before handing over (connection refused, reset,
5xx, no answer in time) is retried on another. A generation hop is never retried (the KV may be half-read;
the context side's lease frees it). A client that goes away, or a deadline that passes, closes the
generation worker's connection, and the generation worker aborts its request. Every failure reaches the
client as an OpenAI error object naming the worker and the reason, never as HTTP 200 with garbage; once a
stream has started, as a final `data: {"error": ...}` event without `[DONE]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .auth import api_keys, install_api_keys, internal_headers
from .balancer import Pool, WorkerRef, routing_key
from .config import ServeConfig
from .metrics import RouterMetrics, render
from .protocol import DEADLINE_HEADER, SSE_DONE, ApiError, add_common_routes, read_json, sse

__all__ = ["main", "build_router"]


def build_router(cfg: ServeConfig) -> FastAPI:
    """The router's FastAPI application for a ServeConfig."""
    rc = cfg.router
    ctx = Pool([WorkerRef.of(s) for s in cfg.context], rc.policy)
    gen = Pool([WorkerRef.of(s) for s in cfg.generation], rc.policy)
    metrics = RouterMetrics()
    client = httpx.AsyncClient(limits=httpx.Limits(max_connections=2048, max_keepalive_connections=256),
                               headers=internal_headers(cfg))  # the deployment's token on every worker call

    def tmo(left: float) -> httpx.Timeout:
        return httpx.Timeout(max(0.05, left), connect=min(rc.connect_timeout_s, max(0.05, left)))

    async def check(w: WorkerRef) -> None:
        try:
            r = await client.get(w.url + "/health", timeout=tmo(min(2.0, rc.health_interval_s * 2)))
            w.mark(r.status_code == 200, "" if r.status_code == 200 else f"/health answered {r.status_code}")
        except httpx.HTTPError as e:
            w.mark(False, f"/health: {type(e).__name__}")

    async def health_loop() -> None:
        while True:
            await asyncio.gather(*(check(w) for w in ctx.workers + gen.workers))
            await asyncio.sleep(rc.health_interval_s)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        task = asyncio.create_task(health_loop())
        try:
            yield
        finally:
            task.cancel()
            await client.aclose()

    app = FastAPI(title="kvbridge router", docs_url=None, redoc_url=None, lifespan=lifespan)
    install_api_keys(app, cfg, api_keys(cfg))  # /v1/* needs a key when any is configured

    @app.exception_handler(ApiError)
    async def _api_error(_req: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = any(w.healthy for w in ctx.workers) and any(w.healthy for w in gen.workers)
        body = {"status": "ok" if ok else "unavailable", "model": cfg.model_name, "policy": rc.policy,
                "context_workers": {w.name: w.healthy for w in ctx.workers},
                "generation_workers": {w.name: w.healthy for w in gen.workers}}
        return JSONResponse(body, status_code=200 if ok else 503)

    add_common_routes(app, cfg.model_name, time.time(), render)

    async def until_gone(request: Request, coro):
        """Await `coro` unless the client goes away first (then cancel it: its connection closes)."""
        task = asyncio.ensure_future(coro)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    raise ApiError(499, "the client went away", "cancelled", "client_closed")
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    async def context_hop(request: Request, path: str, body: dict, deadline: float) -> tuple[dict, WorkerRef]:
        tried: set[str] = set()
        errors: list[str] = []
        while True:
            w = ctx.pick(tried, routing_key(body))
            left = deadline - time.monotonic()
            if w is None or left <= 0:
                why = "; ".join(errors) or f"context workers: {ctx.describe()}"
                if left <= 0:
                    raise ApiError(504, f"no context worker answered before the deadline ({why})",
                                   "timeout_error", "timeout")
                raise ApiError(502 if errors else 503, f"no context worker could prefill the prompt: {why}",
                               "server_error", "context_failed")
            if tried:
                metrics.retries.inc()
            tried.add(w.name)
            hop = min(left, rc.context_timeout_s)
            t0 = time.monotonic()
            w.in_flight += 1
            metrics.in_flight.labels(w.name).inc()
            try:
                r = await until_gone(request, client.post(
                    w.url + path, json={**body, "disaggregated_params": {"request_type": "context_only"}},
                    headers={DEADLINE_HEADER: f"{hop:.3f}"}, timeout=tmo(hop)))
            except httpx.TimeoutException:
                errors.append(f"{w.name}: no answer within {hop:.1f}s")
                continue
            except httpx.TransportError as e:
                w.mark(False, type(e).__name__)
                errors.append(f"{w.name}: {type(e).__name__} {e}".rstrip())
                continue
            finally:
                w.in_flight -= 1
                metrics.in_flight.labels(w.name).dec()
            metrics.hop.labels("context").observe(time.monotonic() - t0)
            data = _json_or_none(r.content)
            handed_over = isinstance(data, dict) and isinstance(data.get("disaggregated_params"), dict)
            if r.status_code == 200 and handed_over:
                return data, w
            if 400 <= r.status_code < 500:
                raise ApiError.from_body(r.status_code, data, f"context worker {w.name}: ")
            if r.status_code == 503:
                w.mark(False, "503")
            errors.append(f"{w.name}: {ApiError.from_body(r.status_code, data).message}")

    def decorate(obj: dict, ctx_data: dict, ctx_w: WorkerRef) -> dict:
        kb = obj.setdefault("kvbridge", {})
        if isinstance(kb, dict):
            kb["context_worker"] = ctx_w.name
            kb["prefill_ms"] = (ctx_data.get("kvbridge") or {}).get("prefill_ms")
        return obj

    async def generation_hop(request: Request, path: str, body: dict, stream: bool, deadline: float,
                             ctx_data: dict, ctx_w: WorkerRef):
        w = gen.pick(key=routing_key(body))
        if w is None:
            raise ApiError(503, "no generation worker is configured", "server_error", "no_generation_worker")
        left = deadline - time.monotonic()
        if left <= 0:
            raise ApiError(504, "the deadline passed before the generation hop", "timeout_error", "timeout")
        hreq = client.build_request("POST", w.url + path, json=body, headers={DEADLINE_HEADER: f"{left:.3f}"},
                                    timeout=tmo(left))
        t0 = time.monotonic()
        w.in_flight += 1
        metrics.in_flight.labels(w.name).inc()
        resp = None
        try:
            try:
                resp = await until_gone(request, client.send(hreq, stream=True))
                if resp.status_code != 200 or not stream:
                    raw = await until_gone(request, resp.aread())
            except httpx.TimeoutException:
                raise ApiError(504, f"generation worker {w.name} did not answer within {left:.1f}s",
                               "timeout_error", "timeout") from None
            except httpx.TransportError as e:
                w.mark(False, type(e).__name__)
                raise ApiError(502, f"generation worker {w.name} failed: {type(e).__name__} {e}".rstrip(),
                               "server_error", "generation_failed") from None
            if resp.status_code != 200:
                raise ApiError.from_body(resp.status_code, _json_or_none(raw),
                                         f"generation worker {w.name}: ")
            if not stream:
                data = _json_or_none(raw)
                if not isinstance(data, dict) or "choices" not in data:
                    raise ApiError.from_body(502, data, f"generation worker {w.name}: ")
                metrics.hop.labels("generation").observe(time.monotonic() - t0)
                return JSONResponse(decorate(data, ctx_data, ctx_w))
        except BaseException:
            w.in_flight -= 1
            metrics.in_flight.labels(w.name).dec()
            if resp is not None:
                await resp.aclose()
            raise
        if not stream:
            w.in_flight -= 1
            metrics.in_flight.labels(w.name).dec()
            await resp.aclose()

        async def relay():
            finished, lines = False, resp.aiter_lines()
            try:
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise asyncio.TimeoutError
                    try:
                        line = await asyncio.wait_for(lines.__anext__(), left)
                    except StopAsyncIteration:
                        break
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        finished = True
                        yield SSE_DONE
                        continue
                    obj = _json_or_none(data)
                    if not isinstance(obj, dict):
                        yield sse(ApiError(502, f"generation worker {w.name} sent a bad event: "
                                                f"{data[:200]!r}", "server_error",
                                           "bad_worker_response").body())
                        return
                    if "error" in obj:
                        yield sse(ApiError.from_body(500, obj, f"generation worker {w.name}: ").body())
                        return
                    if obj.get("choices") and obj["choices"][0].get("finish_reason"):
                        obj = decorate(obj, ctx_data, ctx_w)
                    yield sse(obj)
                if not finished:
                    yield sse(ApiError(502, f"generation worker {w.name} closed the stream before it "
                                            f"finished (the worker failed or was stopped)", "server_error",
                                       "generation_failed").body())
            except asyncio.TimeoutError:
                yield sse(ApiError(504, f"the request did not finish within {rc.request_timeout_s:g}s",
                                   "timeout_error", "timeout").body())
            except httpx.HTTPError as e:
                w.mark(False, type(e).__name__)
                why = f"{type(e).__name__} {e}".rstrip()
                yield sse(ApiError(502, f"generation worker {w.name} failed mid-stream: {why}",
                                   "server_error", "generation_failed").body())
            finally:
                metrics.hop.labels("generation").observe(time.monotonic() - t0)
                w.in_flight -= 1
                metrics.in_flight.labels(w.name).dec()
                await resp.aclose()

        return StreamingResponse(relay(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def handle(request: Request, path: str, endpoint: str):
        deadline = time.monotonic() + rc.request_timeout_s
        status = 200
        try:
            body = await read_json(request)
            if not isinstance(body, dict):
                raise ApiError(400, "the request body must be a JSON object")
            if body.get("model") not in (None, cfg.model_name, cfg.model):
                raise ApiError(404, f"model {body['model']!r} is not served here; this deployment serves "
                                    f"{cfg.model_name!r}", code="model_not_found", param="model")
            if "disaggregated_params" in body:
                raise ApiError(400, "disaggregated_params is set by the router, not by clients",
                               param="disaggregated_params")
            stream = body.get("stream", False) is True
            ctx_data, ctx_w = await context_hop(request, path, body, deadline)
            gen_body = {**body, "disaggregated_params": ctx_data["disaggregated_params"]}
            return await generation_hop(request, path, gen_body, stream, deadline, ctx_data, ctx_w)
        except ApiError as e:
            status = e.status
            raise
        finally:
            metrics.requests.labels(endpoint, str(status)).inc()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "/v1/completions", "completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, "/v1/chat/completions", "chat")

    app.state.pools = (ctx, gen)
    return app


def _json_or_none(raw: bytes | str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="kvbridge router", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="the serving config (YAML)")
    ap.add_argument("--log-level", default="warning", help="uvicorn's log level (default warning)")
    ap.add_argument("--port-file", default=None,
                    help="with router.port 0 in the config: bind a free port and write it here (JSON)")
    ap.add_argument("--api-key", action="append", default=[], help="an API key /v1/* accepts (repeatable)")
    a = ap.parse_args(argv)
    import uvicorn

    from .launcher import die_with_parent

    die_with_parent()
    from ..errors import KvBridgeError
    from .config import load_config

    try:
        cfg = load_config(a.config).with_api_keys(tuple(a.api_key))
    except KvBridgeError as e:
        print(f"kvbridge router: {e}", file=sys.stderr)
        return 2
    if cfg.router.port == 0 and not a.port_file:
        print(f"kvbridge router: router.port is 0 in {a.config}; give it a port, or --port-file to bind a "
              f"free one and write it there", file=sys.stderr)
        return 2
    from .listen import announce, bind

    try:
        sock = bind(cfg.router.bind_host, cfg.router.port)
    except KvBridgeError as e:
        print(f"kvbridge router: {e}", file=sys.stderr)
        return 1
    port = sock.getsockname()[1]
    announce(a.port_file, port)
    server = uvicorn.Server(uvicorn.Config(build_router(cfg), host=cfg.router.bind_host, port=port,
                                           log_level=a.log_level, timeout_graceful_shutdown=5))
    print(f"[router] starting at http://{cfg.router.host}:{port} ({cfg.router.policy}): context "
          f"{[s.url for s in cfg.context]}, generation {[s.url for s in cfg.generation]}", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0 if server.started else 1
