"""The router's side of one hop to a worker: waiting on it while watching the client, reading a worker's
answer, and relaying a generation worker's stream as event objects, then as server-sent events.

Owns turning whatever a worker sends (or fails to send) into event objects or an ApiError naming the worker;
every wait is bounded by the request's deadline. Never picks a worker and never retries (router.py does).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any, AsyncIterator

import httpx
from fastapi import Request

from .balancer import WorkerRef
from .protocol import SSE_DONE, ApiError, sse

__all__ = ["until_gone", "read_body", "Relay", "events", "sse_body", "decoration", "decorate", "json_or_none"]


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


async def read_body(request: Request, resp: httpx.Response, w: WorkerRef, left: float) -> bytes:
    try:
        return await until_gone(request, resp.aread())
    except httpx.TimeoutException:
        raise ApiError(504, f"generation worker {w.name} did not answer within {left:.1f}s",
                       "timeout_error", "timeout") from None
    except httpx.TransportError as e:
        w.mark(False, type(e).__name__)
        raise ApiError(502, f"generation worker {w.name} failed: {type(e).__name__} {e}".rstrip(),
                       "server_error", "generation_failed") from None


def decoration(ctx_data: dict, ctx_w: WorkerRef) -> dict:
    kb = ctx_data.get("kvbridge") or {}
    deco = {"context_worker": ctx_w.name, "prefill_ms": kb.get("prefill_ms")}
    for k in ("prefill_start_unix_ms", "prefill_end_unix_ms", "overlap"):  # overlap measurements
        if kb.get(k) is not None:
            deco[k] = kb[k]
    return deco


def decorate(obj: dict, deco: dict) -> dict:
    kb = obj.setdefault("kvbridge", {})
    if isinstance(kb, dict):
        kb.update(deco)
    return obj


class Relay:
    """A generation worker's stream of event objects; `aclose` ends it and what it owns (the response and
    the worker's in-flight count), whether it was iterated or not."""

    def __init__(self, events: AsyncIterator[dict], owned: contextlib.AsyncExitStack) -> None:
        self._events, self._owned = events, owned

    def __aiter__(self) -> AsyncIterator[dict]:
        return self._events

    async def aclose(self) -> None:
        try:
            await self._events.aclose()
        finally:
            await self._owned.aclose()


async def events(resp: httpx.Response, w: WorkerRef, deadline: float, deco: dict,
                  total_s: float) -> AsyncIterator[dict]:
    """The event objects of a generation worker's stream until [DONE]; ApiError for anything else."""
    lines = resp.aiter_lines()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ApiError(504, f"the request did not finish within {total_s:g}s", "timeout_error", "timeout")
        try:
            line = await asyncio.wait_for(lines.__anext__(), left)
        except StopAsyncIteration:
            raise ApiError(502, f"generation worker {w.name} closed the stream before it finished (the "
                                f"worker failed or was stopped)", "server_error",
                           "generation_failed") from None
        except asyncio.TimeoutError:
            continue
        except httpx.HTTPError as e:
            w.mark(False, type(e).__name__)
            raise ApiError(502, f"generation worker {w.name} failed mid-stream: {type(e).__name__} {e}"
                           .rstrip(), "server_error", "generation_failed") from None
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        obj = json_or_none(data)
        if not isinstance(obj, dict):
            raise ApiError(502, f"generation worker {w.name} sent a bad event: {data[:200]!r}",
                           "server_error", "bad_worker_response")
        if "error" in obj:
            raise ApiError.from_body(500, obj, f"generation worker {w.name}: ")
        if obj.get("choices") and obj["choices"][0].get("finish_reason"):
            obj = decorate(obj, deco)
        yield obj


async def sse_body(events: AsyncIterator[dict], slot: contextlib.ExitStack) -> AsyncIterator[bytes]:
    """Server-sent events of a (merged) stream; an error ends it as a final error event without [DONE]."""
    try:
        yield b": kvbridge\n\n"  # a comment: starts the body at once (see router.Router._stream)
        async for obj in events:
            yield sse(obj)
        yield SSE_DONE
    except ApiError as e:
        yield sse(e.body())
    finally:
        with contextlib.suppress(BaseException):
            await events.aclose()
        slot.close()


def json_or_none(raw: bytes | str) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None
