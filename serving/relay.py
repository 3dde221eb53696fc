"""The router's side of one hop to a worker: waiting on it while watching the client, reading a worker's
answer, and relaying a generation worker's stream as event objects, then as server-sent events.

Owns turning whatever a worker sends (or fails to send) into event objects or an ApiError naming the worker;
every wait is bounded by the request's deadline. The two failure shapes every hop shares live here:
`from_worker` (a generation/decode step: a timeout is the client's 504, a broken connection its 502, the
worker marked down) and `context_send` (a context/prefill hop: a connection the worker closed under us is
retried once, fresh; any other failure raises the caller's "try another worker" exception). Never picks a
worker and never retries on another one (router.py, vllm_backend.py do).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any, AsyncIterator, Awaitable, Callable

import httpx
from fastapi import Request

from .balancer import WorkerRef
from .protocol import SSE_DONE, ApiError, sse

__all__ = ["until_gone", "from_worker", "RERUN_CODES", "context_send", "read_body", "Relay", "events", "sse_body",
           "decoration", "decorate", "json_or_none"]


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


async def from_worker(request: Request, coro, w: WorkerRef, who: str, late: str, sending: bool = False) -> Any:
    """Await one step of a generation (decode) hop: sending it, or reading its answer.

    Args:
        request: the client's request (its going away cancels the step: ApiError 499).
        coro: the step, e.g. `client.send(req, stream=True)` or `resp.aread()` (bounded by its own timeout).
        w: the worker it talks to; marked down when its connection fails.
        who: how the error names the worker's kind, e.g. "generation worker" or "decode server".
        late: how the error says it timed out, e.g. "did not answer within 3.0s".
        sending: the step is the send, awaiting the answer's first byte (nothing has reached the client yet).
    Returns:
        what `coro` returns.
    Raises:
        ApiError: 504 timeout_error when it timed out; 502 when the connection failed: generation_unreachable
            when it could not even connect, generation_dropped when it broke while `sending` (either way the
            router may run the request elsewhere), generation_failed otherwise.
    """
    try:
        return await until_gone(request, coro)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        raise ApiError(504, f"{who} {w.name} {late}", "timeout_error", "timeout") from None
    except httpx.TransportError as e:
        w.mark(False, type(e).__name__)
        code = ("generation_unreachable" if isinstance(e, httpx.ConnectError) else
                "generation_dropped" if sending else "generation_failed")
        what = "failed before answering" if sending else "failed"
        raise ApiError(502, f"{who} {w.name} {what}: {type(e).__name__} {e}".rstrip(), "server_error",
                       code) from None


# failures after which the router runs a choice again from its prefill: a failed KV pull, or a generation
# (decode) worker that could not be reached or whose connection broke while the request was being sent
# (`from_worker(sending=True)`: nothing reached the client; the worker is marked down, the next pick skips it)
RERUN_CODES = ("kv_transfer_failed", "generation_unreachable", "generation_dropped")

Send = Callable[[], Awaitable[httpx.Response]]  # one attempt of a hop: a fresh request each call


async def context_send(request: Request, w: WorkerRef, hop: float, send: Send,
                       failed: type[Exception]) -> httpx.Response:
    """Send one context (prefill) hop: `send()` makes one attempt; a connection the worker closed under us
    (a stale pooled connection) is retried once, fresh.

    Raises:
        failed: "<worker>: <why>", when it timed out (no answer within `hop` seconds) or the connection failed
            (the worker marked down); the caller tries another worker.
        ApiError: 499, the client went away.
    """
    for fresh in (False, True):
        try:
            return await until_gone(request, send())
        except httpx.TimeoutException:
            raise failed(f"{w.name}: no answer within {hop:.1f}s") from None
        except (httpx.RemoteProtocolError, httpx.ReadError) as e:
            if fresh:
                w.mark(False, type(e).__name__)
                raise failed(f"{w.name}: {type(e).__name__} {e}".rstrip()) from None
        except httpx.TransportError as e:
            w.mark(False, type(e).__name__)
            raise failed(f"{w.name}: {type(e).__name__} {e}".rstrip()) from None
    raise AssertionError("unreachable")  # the second attempt returns or raises


async def read_body(request: Request, resp: httpx.Response, w: WorkerRef, left: float) -> bytes:
    return await from_worker(request, resp.aread(), w, "generation worker",
                             f"did not answer within {left:.1f}s")


def decoration(ctx_data: dict, ctx_w: WorkerRef) -> dict:
    kb = ctx_data.get("kvbridge") or {}
    deco = {"context_worker": ctx_w.name, "prefill_ms": kb.get("prefill_ms")}
    for k in ("prefill_start_unix_ms", "prefill_end_unix_ms", "overlap"):  # overlap measurements
        if kb.get(k) is not None:
            deco[k] = kb[k]
    if isinstance(kb.get("reused_tokens"), int):  # the context worker's prefix-cache hit (bench route)
        deco["context_reused_tokens"] = kb["reused_tokens"]
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
