"""The router's half of overlap: one context hop that hands the request to the generation side early.

With router.overlap (the default) a context hop asks for the early handover (overlap_worker.py): the
context worker answers NDJSON, line 1 as soon as the prefill is admitted (the request's generation_only
disaggregated_params without the first token), line 2 when the prefill ended (the usual answer). On line 1
the router posts POST /internal/prefetch to the generation worker it picked before the prefill, so the
generation side allocates and pulls each layer group while the prefill runs. On line 2 it posts the first
token straight away (POST /internal/join, a few hundred bytes: decoding starts), then the usual generation
hop carries the request and claims the prefetch.

Owns that hop's reading and its failure paths: anything that goes wrong after line 1 (the context worker
dies, errs, or its deadline passes) first releases the prefetch on the generation worker (POST
/internal/release), then fails the hop like a sequential one (so the router tries another context worker);
a prefetch the generation worker refuses (503, or anything else) is only logged: the generation hop then
runs sequentially. Every wait is bounded by the hop's deadline. Never touches KV.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx
from fastapi import Request

from .balancer import WorkerRef
from .inflight import in_flight
from .protocol import DEADLINE_HEADER
from .relay import context_send, json_or_none, until_gone

log = logging.getLogger("kvbridge.serving.router")

__all__ = ["ContextFailed", "context_early", "release_prefetch", "HANDOVER_HEADER", "NDJSON"]

HANDOVER_HEADER = "x-kvbridge-handover"  # "early": the context worker answers NDJSON (overlap_worker.py)
NDJSON = "application/x-ndjson"
PREFETCH_TIMEOUT_S = 5.0  # the generation worker only submits: it answers in milliseconds


class ContextFailed(Exception):
    """The context hop failed before a usable answer (the router tries another context worker)."""


async def context_early(router, request: Request, w: WorkerRef, path: str, body: dict, hop: float,
                        gen_w: WorkerRef) -> tuple[int, Any]:
    """One context hop with the early handover; returns (HTTP status, the answer's JSON) like a sequential
    hop's response. Raises ContextFailed (the hop failed) or ApiError (the client went away)."""
    payload = {**body, "disaggregated_params": {"request_type": "context_only"}}
    t0 = time.monotonic()
    deadline = t0 + hop
    with in_flight(w, router.metrics.in_flight.labels(w.name)):
        resp = await _send(router, request, w, path, payload, hop)
        try:
            if resp.status_code != 200 or not resp.headers.get("content-type", "").startswith(NDJSON):
                raw = await until_gone(request, resp.aread())
                return resp.status_code, json_or_none(raw)
            lines = resp.aiter_lines()
            first = await _next_line(request, lines, w)
            handover = first.get("handover") if isinstance(first, dict) else None
            if not isinstance(handover, dict):
                raise ContextFailed(f"{w.name}: its first line is not a handover")
            prefetched = await _prefetch(router, request, gen_w, path, body, handover, deadline)
            try:
                final = await _next_line(request, lines, w)
            except BaseException:
                if prefetched:
                    await release_prefetch(router, gen_w, handover)
                raise
            if isinstance(final, dict) and "error" in final and prefetched:
                await release_prefetch(router, gen_w, handover)
            router.metrics.hop.labels("context").observe(time.monotonic() - t0)
            if isinstance(final, dict) and "error" in final:
                status = final.pop("status", 502)
                return status if type(status) is int and 400 <= status < 600 else 502, final
            dp = final.get("disaggregated_params") if isinstance(final, dict) else None
            if isinstance(dp, dict):  # (line 2 leaves out the prompt's token ids: line 1 had them)
                dp.setdefault("prompt_token_ids", handover.get("prompt_token_ids"))
                if prefetched:  # decoding starts now, before the generation request is even sent
                    await _join(router, gen_w, handover.get("ctx_params"), dp.get("first_token"))
            kb = final.get("kvbridge") if isinstance(final, dict) else None
            if isinstance(kb, dict):
                kb["prefill_start_unix_ms"] = first.get("prefill_start_unix_ms")
                kb["overlap"] = prefetched
            return 200, final
        except httpx.TimeoutException:
            raise ContextFailed(f"{w.name}: no answer within {hop:.1f}s") from None
        except httpx.TransportError as e:
            w.mark(False, type(e).__name__)
            raise ContextFailed(f"{w.name}: {type(e).__name__} {e}".rstrip()) from None
        finally:
            await resp.aclose()


async def _send(router, request: Request, w: WorkerRef, path: str, payload: dict, hop: float) -> httpx.Response:
    """Open the hop's response (relay.context_send: retried once, fresh, on a connection closed under us)."""
    def send():
        req = router.client.build_request("POST", w.url + path, json=payload, timeout=router._tmo(hop),
                                          headers={DEADLINE_HEADER: f"{hop:.3f}", HANDOVER_HEADER: "early"})
        return router.client.send(req, stream=True)

    return await context_send(request, w, hop, send, ContextFailed)


async def _next_line(request: Request, lines, w: WorkerRef) -> Any:
    try:
        line = await until_gone(request, lines.__anext__())
    except StopAsyncIteration:
        raise ContextFailed(f"{w.name}: its answer ended early") from None
    got = json_or_none(line.encode())
    if got is None:
        raise ContextFailed(f"{w.name}: a line of its answer is not JSON")
    return got


async def _prefetch(router, request: Request, gen_w: WorkerRef, path: str, body: dict, handover: dict,
                    deadline: float) -> bool:
    """Tell the generation worker of the request now; True when it took it (failures only logged)."""
    kind = "chat" if path.endswith("/chat/completions") else "completion"
    left = deadline - time.monotonic()
    if left <= 0:
        return False
    payload = {"kind": kind, "request": {**body, "disaggregated_params": handover}}
    try:
        r = await until_gone(request, router.client.post(
            gen_w.url + "/internal/prefetch", json=payload, timeout=router._tmo(min(left, PREFETCH_TIMEOUT_S)),
            headers={DEADLINE_HEADER: f"{left:.3f}"}))
    except httpx.HTTPError as e:
        log.info("router: prefetch on %s failed (%s); the generation hop runs after the prefill", gen_w.name,
                 type(e).__name__)
        return False
    if r.status_code != 200:
        log.info("router: %s refused a prefetch (%d); the generation hop runs after the prefill", gen_w.name,
                 r.status_code)
        return False
    return True


async def _join(router, gen_w: WorkerRef, ctx_params: Any, first_token: Any) -> None:
    """The first token to the prefetched request (best effort: the generation request joins it otherwise)."""
    try:
        await router.client.post(gen_w.url + "/internal/join", timeout=router._tmo(PREFETCH_TIMEOUT_S),
                                 json={"ctx_params": ctx_params, "first_token": first_token})
    except httpx.HTTPError as e:
        log.info("router: join on %s failed (%s); the generation request joins it", gen_w.name,
                 type(e).__name__)


async def release_prefetch(router, gen_w: WorkerRef, dp: dict) -> None:
    """Abort a prefetched request on the generation worker (best effort, bounded)."""
    try:
        await router.client.post(gen_w.url + "/internal/release", timeout=router._tmo(2.0),
                                 json={"disaggregated_params": dp})
    except httpx.HTTPError as e:
        log.warning("router: could not release a prefetch on %s: %s", gen_w.name, type(e).__name__)
