"""The router's hops when the workers are vLLM OpenAI servers (`engine: vllm`): vLLM's prefill/decode proxy
protocol, with kvbridge's deadlines, retries and errors.

One choice runs as (vLLM's disaggregated-serving protocol, as its toy proxy speaks it):
    1. POST prefill/v1/(chat/)completions: the client's body with max_tokens 1, not streamed, and
       kv_transfer_params {"do_remote_decode": true, "do_remote_prefill": false, remote_*: null};
    2. its answer's top-level `kv_transfer_params` (opaque: the connector's, KVBridgeConnector's or
       NixlConnector's) go, with the client's whole body, to
    3. POST decode/v1/(chat/)completions, streamed or not as the client asked; its answer is the client's.
vLLM reports a failure on the decode side (a KV load that failed, a prefill server that died) as HTTP 200
with an error event in the stream (`data: {"error": {...}}`), or an error object in a 200 body; here every
such answer becomes a real error: before the first token an HTTP error (502 `kv_transfer_failed`, after the
choice was run again from another prefill server up to MAX_HANDOVERS times within the deadline), after it a
final error event without [DONE]. A prefill server that fails before answering is retried on another; a
decode server that cannot be reached, or whose connection breaks before it answers (it died or is leaving),
is marked down and the choice runs again on another.
Clients may not send `kv_transfer_params` (the router's alone: a client's could name another request's
KV). `n` > 1 and a list of prompts fan out into one choice each (fanout.expand_unread: a seeded request's
choice j runs with seed + j), answered merged as one; `best_of` other than 1 or `n` is refused by name.
Everything else is vLLM's to validate.

Early decode (`router.overlap`, on by default; KVBridgeConnector only): once a prefill server has answered
once, the router knows its engine (instance, endpoints, layout: the answer's `kvbridge` object) and sends both
hops at once under a handle and secret it mints (kvbridge/integrations/vllm/params.py): the decode server
pulls each layer as the prefill's forward writes it. A prefill that fails cancels the decode; a decode that
fails before its first token, or an engine that changed, falls back to the sequential protocol above.

Under `policy: kv_aware` both hops go where the prompt's KV sits, by the events each server's member relays
(vllm_kv_relay.py); a text prompt's token ids come from vLLM's own /tokenize (vllm_tokens.py).

Owns no worker pools, admission or metrics (the Router's, router.py) and never imports vLLM or the
connector: `kv_transfer_params` pass through unread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from typing import Any, AsyncIterator

import httpx
from fastapi import Request

from .auth import internal_token
from .balancer import WorkerRef, routing_key
from .fanout import Part, expand_unread
from .inflight import in_flight
from .kv_policy import shown
from .vllm_tokens import prompt_tokens
from .protocol import ApiError
from .relay import RERUN_CODES, Relay, context_send, from_worker, json_or_none

__all__ = ["VllmBackend", "PREFILL_KV_PARAMS", "prefill_body", "decode_body", "stream_error", "engine_of",
           "early_hops"]

log = logging.getLogger("kvbridge.serving.vllm_backend")

MAX_HANDOVERS = 3  # runs of one choice after its decode hop failed before the first token
PREFILL_KV_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                     "remote_block_ids": None, "remote_host": None, "remote_port": None}
_PREFILL_DROP = ("stream", "stream_options", "min_tokens", "max_completion_tokens", "n", "best_of")


def prefill_body(body: dict) -> dict:
    """The prefill hop's body: the client's, one token, not streamed, asking the server to keep the KV."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROP}
    out.update(max_tokens=1, stream=False, kv_transfer_params=dict(PREFILL_KV_PARAMS))
    return out


def decode_body(body: dict, kv_transfer_params: dict) -> dict:
    """The decode hop's body: the client's whole request plus the prefill's kv_transfer_params."""
    return {**body, "kv_transfer_params": kv_transfer_params}


def engine_of(kvp: Any) -> dict | None:
    """A prefill engine as a KVBridgeConnector answer describes it (its `kvbridge` object's instance,
    endpoints, layout and packing); None for any other answer (NixlConnector's)."""
    body = kvp.get("kvbridge") if isinstance(kvp, dict) else None
    if not isinstance(body, dict) or not isinstance(body.get("endpoints"), list):
        return None
    return {k: v for k, v in body.items() if k in _ENGINE_KEYS}


def early_hops(engine: dict) -> tuple[dict, dict]:
    """One early decode under a fresh handle and secret: (the prefill's `kvbridge_early` object, the decode's
    kv_transfer_params) (kvbridge/integrations/vllm/params.py)."""
    handle, secret = secrets.randbits(63) or 1, secrets.token_hex(16)
    return ({"ctx_request_id": handle, "secret": secret},
            {"do_remote_prefill": True, "do_remote_decode": False,
             "kvbridge": {**engine, "version": 1, "early": True, "ctx_request_id": handle, "secret": secret}})


def stream_error(obj: Any) -> str | None:
    """The message of a vLLM error event or error body ({"error": {...}} or {"object": "error", ...})."""
    if not isinstance(obj, dict):
        return None
    err = obj.get("error")
    if isinstance(err, dict):
        return str(err.get("message") or err)[:500]
    if isinstance(err, str):
        return err[:500]
    if obj.get("object") == "error":
        return str(obj.get("message") or obj)[:500]
    return None


class VllmBackend:
    """The vLLM hops of one Router (its pools, client, metrics and config are used, not owned)."""

    def __init__(self, router) -> None:
        self.r = router
        token = internal_token(router.cfg)  # vLLM's /v1/* API key under `kvbridge serve`
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._engines: dict[str, dict] = {}  # prefill server -> its engine, from its last answer (early decode)
        self._background: set[asyncio.Task] = set()

    def parts(self, body: dict, kind: str) -> list[Part]:
        """The request's choices (`n`, a list of prompts: fanout.expand_unread; vLLM validates the rest)."""
        if "kv_transfer_params" in body:
            raise ApiError(400, "kv_transfer_params is set by the router, not by clients",
                           param="kv_transfer_params")
        return expand_unread(body, kind, self.r.cfg.model_name)

    async def run_part(self, request: Request, path: str, body: dict, stream: bool, deadline: float):
        """Prefill, then decode; a decode hop that fails before its first token runs the choice again from
        another prefill server. Returns the answer (dict) or, streaming, a Relay of event objects."""
        route = None
        if self.r.kv is not None:  # kv_aware: the prompt's token ids as vLLM sees them, then the picks
            route = {"policy": "kv_aware", "tokens": await prompt_tokens(self, body, deadline)}
        if self.r.rc.overlap:
            got = await self._early(request, path, body, stream, deadline, route)
            if got is not None:
                return got
        avoid: set[str] = set()
        for attempt in range(MAX_HANDOVERS):
            if route is None:
                gen_w = self.r.gen.pick(key=routing_key(body), healthy_only=True)
            else:  # kv_aware: by the KV each decode server holds (its member relays vLLM's events)
                gen_w, route["generation"] = self.r.kv.pick(self.r.gen, "generation", route["tokens"],
                                                            healthy_only=True)
            if gen_w is None:
                raise ApiError(503, f"no decode server is healthy ({self.r.gen.describe()}); nothing was "
                                    f"prefilled", "server_error", "no_generation_worker", retry_after=2)
            kvp, ctx_w, pre_ms = await self._prefill(request, path, body, deadline, avoid, route)
            deco = {"context_worker": ctx_w.name, "generation_worker": gen_w.name, "prefill_ms": pre_ms,
                    **(shown(route) if route is not None else {})}
            try:
                return await self._decode(request, path, decode_body(body, kvp), stream, deadline, gen_w,
                                          deco)
            except ApiError as e:
                last = attempt == MAX_HANDOVERS - 1 or time.monotonic() >= deadline
                if e.code not in RERUN_CODES or last:
                    raise
                log.warning("router: decode on %s failed after the prefill on %s (%s); running it again",
                            gen_w.name, ctx_w.name, e.message)
                if e.code == "kv_transfer_failed":  # (a decode server that broke is marked down instead)
                    avoid.add(ctx_w.name)
                self.r.metrics.retries.inc()
        raise AssertionError("unreachable")  # the loop returns or raises

    async def _early(self, request: Request, path: str, body: dict, stream: bool, deadline: float,
                     route: dict | None = None):
        """Both hops at once on a prefill server whose engine is known; None to run the choice sequentially
        (unknown engine, or a failure before the decode's first token)."""
        if route is not None:
            ctx_w, gen_w, settle = self._early_kv(route)
        else:
            key = routing_key(body)
            ctx_w = self.r.ctx.peek(set(), key)  # peeked: a request that runs sequentially takes no turn here
            gen_w = self.r.gen.peek(key=key, healthy_only=True)
            settle = None
        engine = self._engines.get(ctx_w.name) if ctx_w is not None else None
        if engine is None or gen_w is None:
            if settle is not None:
                settle()
            return None
        self.r.ctx.picked(ctx_w)
        self.r.gen.picked(gen_w)
        payload = prefill_body(body)
        payload["kv_transfer_params"]["kvbridge_early"], kvp = early_hops(engine)
        deco = {"context_worker": ctx_w.name, "generation_worker": gen_w.name, "early_decode": True,
                **(shown(route) if route is not None else {})}
        pre = asyncio.create_task(self._prefill_once(request, path, payload, ctx_w, deadline))
        pre.add_done_callback(lambda t: self._learn(ctx_w.name, t))
        if settle is not None:
            pre.add_done_callback(lambda _t: settle())
        dec = asyncio.create_task(self._decode(request, path, decode_body(body, kvp), stream, deadline, gen_w,
                                               deco))
        answered = False
        try:
            await asyncio.wait({pre, dec}, return_when=asyncio.FIRST_COMPLETED)
            failed = pre.exception() if pre.done() else None
            if failed is not None and not dec.done():
                dec.cancel()  # its prefill failed: no KV will come; closing the stream aborts it in vLLM
                await asyncio.gather(dec, return_exceptions=True)
                if isinstance(failed, ApiError):
                    raise failed  # the prefill server refused the request itself (4xx): so would any
                self._forget(ctx_w.name, failed)
                return None
            try:
                out = await dec
            except ApiError as e:
                if e.code not in RERUN_CODES or time.monotonic() >= deadline:
                    raise
                self._forget(ctx_w.name, e)
                return None
            answered = True
            return out
        finally:
            if not dec.done():
                dec.cancel()
            if not pre.done():
                if answered:  # its answer follows the decode's first token by a step
                    self._background.add(pre)
                    pre.add_done_callback(self._background.discard)
                else:  # nobody will read what it publishes: abort it in vLLM
                    pre.cancel()

    def _early_kv(self, route: dict):
        """kv_aware's picks for early decode: (prefill server, decode server, the prefill load's undo)."""
        kv = self.r.kv
        ctx_w, route["context"] = kv.pick(self.r.ctx, "context", route["tokens"])
        if ctx_w is None:
            return None, None, None
        gen_w, route["generation"] = kv.pick(self.r.gen, "generation", route["tokens"], healthy_only=True)
        return ctx_w, gen_w, lambda d=route["context"]: kv.settle(ctx_w, d)

    def _learn(self, name: str, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is None:  # (a failure is read here, never lost)
            self._remember(name, task.result()[0])

    def _remember(self, name: str, kvp: dict) -> None:
        """Keep a prefill server's engine from its answer (KVBridgeConnector's `kvbridge` object)."""
        engine = engine_of(kvp)
        if engine is not None:
            self._engines[name] = engine

    def _forget(self, name: str, why) -> None:
        log.warning("router: early decode on prefill server %s failed (%s); running the request "
                    "sequentially", name, why)
        self._engines.pop(name, None)
        self.r.metrics.retries.inc()

    # --- hops -----------------------------------------------------------------------------------------
    def _timeout(self, left: float) -> httpx.Timeout:
        return httpx.Timeout(max(0.05, left), connect=min(self.r.rc.connect_timeout_s, max(0.05, left)))

    async def _prefill(self, request: Request, path: str, body: dict, deadline: float,
                       avoid: set[str], route: dict | None = None) -> tuple[dict, WorkerRef, float]:
        """The prefill hop on a prefill server (one not in `avoid` if any is left), retried on another when
        one fails before answering. Returns (kv_transfer_params, the server, milliseconds)."""
        tried: set[str] = set()
        errors: list[str] = []
        payload = prefill_body(body)
        while True:
            left = deadline - time.monotonic()
            w = self._pick_prefill(body, tried, avoid, route) if left > 0 else None
            if w is None:
                why = "; ".join(errors) or f"prefill servers: {self.r.ctx.describe()}"
                if left <= 0:
                    raise ApiError(504, f"no prefill server answered before the deadline ({why})",
                                   "timeout_error", "timeout")
                raise ApiError(502 if errors else 503, f"no prefill server could prefill the prompt: {why}",
                               "server_error", "context_failed", retry_after=None if errors else 2)
            tried.add(w.name)
            try:
                kvp, ms = await self._prefill_once(request, path, payload, w, deadline)
            except _Failed as e:
                errors.append(str(e))
                continue
            finally:
                if route is not None:
                    self.r.kv.settle(w, route.get("context"))
            self._remember(w.name, kvp)
            return kvp, w, ms

    def _pick_prefill(self, body: dict, tried: set[str], avoid: set[str],
                      route: dict | None) -> WorkerRef | None:
        """A prefill server not tried yet (one not in `avoid` if any is left): by the policy, or under
        kv_aware by the KV each holds (the decision goes into `route`)."""
        if route is None:
            key = routing_key(body)
            return self.r.ctx.pick(tried | avoid, key) or self.r.ctx.pick(tried, key)
        for ex in (tried | avoid, tried):
            w, route["context"] = self.r.kv.pick(self.r.ctx, "context", route["tokens"], ex)
            if w is not None:
                return w
        return None

    async def _prefill_once(self, request: Request, path: str, payload: dict, w: WorkerRef,
                            deadline: float) -> tuple[dict, float]:
        """One prefill hop on `w`: (kv_transfer_params, milliseconds); _Failed when it did not answer well."""
        hop = min(max(0.05, deadline - time.monotonic()), self.r.rc.context_timeout_s)
        t0 = time.monotonic()
        with in_flight(w, self.r.metrics.in_flight.labels(w.name)):
            r = await context_send(request, w, hop, lambda: self.r.client.post(
                w.url + path, json=payload, headers=self.headers, timeout=self._timeout(hop)), _Failed)
        ms = (time.monotonic() - t0) * 1e3
        self.r.metrics.hop.labels("context").observe(ms / 1e3)
        data = json_or_none(r.content)
        if 400 <= r.status_code < 500 and r.status_code != 429:
            raise ApiError.from_body(r.status_code, data, f"prefill server {w.name}: ")
        kvp = data.get("kv_transfer_params") if isinstance(data, dict) else None
        if r.status_code == 200 and isinstance(kvp, dict) and stream_error(data) is None:
            return kvp, round(ms, 3)
        why = stream_error(data) or (f"HTTP {r.status_code}" if r.status_code != 200 else
                                     "answered without kv_transfer_params (is it started with a "
                                     "--kv-transfer-config?)")
        raise _Failed(f"{w.name}: {why}")

    async def _decode(self, request: Request, path: str, body: dict, stream: bool, deadline: float,
                      w: WorkerRef, deco: dict):
        left = deadline - time.monotonic()
        if left <= 0:
            raise ApiError(504, "the deadline passed before the decode hop", "timeout_error", "timeout")
        stack = contextlib.AsyncExitStack()
        async with stack:
            stack.enter_context(in_flight(w, self.r.metrics.in_flight.labels(w.name)))
            t0 = time.monotonic()
            req = self.r.client.build_request("POST", w.url + path, json=body, headers=self.headers,
                                              timeout=self._timeout(left))
            resp = await from_worker(request, self.r.client.send(req, stream=True), w, "decode server",
                                     f"did not answer within {left:.1f}s", sending=True)
            stack.push_async_callback(resp.aclose)
            if resp.status_code != 200 or not stream:
                raw = await self._read(request, resp, w, deadline)
                data = json_or_none(raw)
                if resp.status_code >= 500 or (resp.status_code == 200 and stream_error(data) is not None):
                    raise _failed(w, stream_error(data) or f"HTTP {resp.status_code}")
                if resp.status_code != 200:
                    raise ApiError.from_body(resp.status_code, data, f"decode server {w.name}: ")
                if not isinstance(data, dict) or not isinstance(data.get("choices"), list) or \
                        not data["choices"]:
                    raise ApiError.from_body(502, data, f"decode server {w.name}: ")
                self.r.metrics.hop.labels("generation").observe(time.monotonic() - t0)
                kvp = data.pop("kv_transfer_params", None)  # KVBridgeConnector: the pull's bytes and ms
                transfer = kvp.get("kvbridge_transfer") if isinstance(kvp, dict) else None
                data["kvbridge"] = {**(data.get("kvbridge") or {}), **deco,
                                    **({"transfer": transfer} if isinstance(transfer, dict) else {})}
                return data
            lines = resp.aiter_lines()
            first = await _next_event(lines, w, deadline)  # the first token or the failure: the status
            if first is None or first is _DONE:
                raise _failed(w, "the stream ended before the first token")
            if stream_error(first) is not None:
                raise _failed(w, stream_error(first))
            return Relay(_events(first, lines, w, deadline, deco), stack.pop_all())

    async def _read(self, request: Request, resp: httpx.Response, w: WorkerRef, deadline: float) -> bytes:
        left = max(0.05, deadline - time.monotonic())
        return await from_worker(request, asyncio.wait_for(resp.aread(), left), w, "decode server",
                                 "did not finish before the deadline")


_ENGINE_KEYS = ("ctx_instance", "endpoints", "ctx_layout", "layout_fingerprint", "packing")


class _Failed(Exception):
    """A prefill hop that failed before an answer (another prefill server is tried)."""


def _failed(w: WorkerRef, why: str) -> ApiError:
    return ApiError(502, f"decode server {w.name} failed the request before its first token (vLLM: {why}); "
                         f"the KV transfer from the prefill server or the decode failed", "server_error",
                    "kv_transfer_failed")


_DONE: dict = {}  # the [DONE] event


async def _next_event(lines: AsyncIterator[str], w: WorkerRef, deadline: float) -> dict | None:
    """The next `data:` event object of a vLLM stream; _DONE at [DONE], None when it ended without one."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ApiError(504, "the request did not finish before its deadline", "timeout_error", "timeout")
        try:
            line = await asyncio.wait_for(lines.__anext__(), left)
        except StopAsyncIteration:
            return None
        except asyncio.TimeoutError:
            continue
        except httpx.HTTPError as e:
            w.mark(False, type(e).__name__)
            raise ApiError(502, f"decode server {w.name} failed mid-stream: {type(e).__name__} {e}".rstrip(),
                           "server_error", "generation_failed") from None
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return _DONE
        obj = json_or_none(data)
        if not isinstance(obj, dict):
            raise ApiError(502, f"decode server {w.name} sent a bad event: {data[:200]!r}", "server_error",
                           "bad_worker_response")
        return obj


async def _events(first: dict, lines: AsyncIterator[str], w: WorkerRef, deadline: float,
                  deco: dict) -> AsyncIterator[dict]:
    """The decode server's event objects, the first one included; an error event raises (the router ends
    the client's stream with it, without [DONE]), and so does a stream cut before [DONE]."""
    obj: dict | None = first
    while obj is not _DONE:
        if obj is None:
            raise ApiError(502, f"decode server {w.name} closed the stream before it finished",
                           "server_error", "generation_failed")
        msg = stream_error(obj)
        if msg is not None:
            raise ApiError(502, f"decode server {w.name} failed mid-stream (vLLM: {msg})", "server_error",
                           "generation_failed")
        obj.pop("kv_transfer_params", None)
        if obj.get("choices") and (obj["choices"][0] or {}).get("finish_reason"):
            obj["kvbridge"] = deco
        yield obj
        obj = await _next_event(lines, w, deadline)
