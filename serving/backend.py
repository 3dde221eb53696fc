"""A worker's executor seen from asyncio: prefill, follow a request's tokens, abort it when its caller goes.

Owns the threads that block on the Executor handle (every call bounded: waits are sliced into short polls
so a gone client or a passed deadline is noticed within POLL_S) and the bookkeeping of context requests
whose KV is still pinned. Never frees KV itself: a generation request is ended with Executor.abort, and a
context request's blocks are released by the transceiver hook once its reader confirmed, or when its lease
or pickup time runs out.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

from ..errors import ExecutorError, KVCacheExhausted
from ..executor.runtime import Completion, ContextResult, Executor
from ..executor.sampling import SamplingParams, TokenLogprob
from .protocol import ApiError

__all__ = ["Backend", "Progress", "POLL_S"]

POLL_S = 0.25


@dataclass(frozen=True)
class Progress:
    """A followed request so far: its tokens, the logprob entries of those sampled here (when asked for),
    and its Completion once it finished (else None)."""

    tokens: list[int]
    logprobs: list[TokenLogprob]
    done: Completion | None = None


class Backend:
    """Async calls on one Executor.

    Args:
        ex: the running executor (this object does not close it).
        threads: most executor calls blocked at once (one per request being waited on).
    """

    def __init__(self, ex: Executor, threads: int = 256) -> None:
        self.ex = ex
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvbridge-exec")
        self._probe = ThreadPoolExecutor(1, thread_name_prefix="kvbridge-probe")  # never queued behind requests
        self._lock = threading.Lock()
        self.pinned: set[int] = set()  # context requests published and not released yet
        self.released = 0
        self.in_flight = 0
        self._stats_lock = asyncio.Lock()

    async def call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def prefill(self, prompt: list[int], sampling: SamplingParams, timeout: float) -> ContextResult:
        """Context-only prefill; its KV stays pinned for the transceiver (released by the hook)."""
        try:
            res = await self.call(lambda: self.ex.prefill(prompt, sampling=sampling, timeout=timeout))
        except (ExecutorError, KVCacheExhausted) as e:
            raise self.error(e, "prefill") from None
        self.pin(res.request_id)
        return res

    def pin(self, rid: int) -> None:
        """Count a prefilled context request as pinned (released by the hook, or `drop_context`)."""
        with self._lock:
            self.pinned.add(rid)

    def collect_released(self) -> int:
        """Fold in the context requests the hook released since last time; returns how many are pinned."""
        ids = self.ex.take_released()
        with self._lock:
            for rid in ids:
                self.pinned.discard(rid)
            self.released += len(ids)
            return len(self.pinned)

    def pinned_ids(self) -> list[int]:
        """The context requests this worker pins now (a copy)."""
        with self._lock:
            return list(self.pinned)

    def drop_context(self, rid: int) -> bool:
        """Drop a pinned context request now (its generation side refused it): the transceiver stops serving
        it and its blocks are freed once readers in flight settled. False if it is not pinned here."""
        with self._lock:
            if rid not in self.pinned:
                return False
            self.pinned.discard(rid)
            self.released += 1
        self.abort(rid)
        return True

    async def follow(self, rid: int, deadline: float,
                     gone: Callable[[], Awaitable[bool]] | None = None
                     ) -> AsyncIterator[Progress]:
        """Yield Progress (done None) as a submitted request grows, then once with its Completion.

        The request is aborted if the caller stops iterating early, `gone()` turns true, the deadline passes
        or the executor fails.
        """
        have, finished = 0, False
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ApiError(504, f"the request did not finish before its deadline (request {rid})",
                                   "timeout_error", "timeout")
                try:
                    toks, lps, done = await self.call(self.ex.wait_stream, rid, have, min(POLL_S, left))
                except (ExecutorError, KVCacheExhausted) as e:
                    finished = True  # refused or the executor failed: nothing left to abort
                    raise self.error(e, "generation") from None
                if done is not None:
                    finished = True
                    yield Progress(toks, lps, done)
                    return
                if len(toks) > have:
                    have = len(toks)
                    yield Progress(toks, lps)
                if gone is not None and await gone():
                    raise ApiError(499, "the client went away", "cancelled", "client_closed")
        finally:
            if not finished:
                self.abort(rid)

    def abort(self, rid: int) -> None:
        """End a request now; its 'done' event is drained in the background so nothing is left behind."""
        try:
            self.ex.abort(rid)
        except ExecutorError:
            return
        self._pool.submit(self._drain, rid)

    def _drain(self, rid: int) -> None:
        try:
            self.ex.wait(rid, timeout=30)
        except (ExecutorError, KVCacheExhausted):
            pass

    async def free_blocks(self) -> list[int]:
        try:
            return await self._stats_round(self._pool, 30.0)
        except ExecutorError as e:
            raise self.error(e, "free_blocks") from None

    async def ranks_answer(self, timeout: float) -> bool:
        """Whether every rank answered one stats round within `timeout` (worker_state.watch_ranks): on a thread
        of its own, so a worker whose request threads are all taken still probes its ranks at once."""
        try:
            await self._stats_round(self._probe, timeout)
        except ExecutorError:
            return False
        return True

    async def _stats_round(self, pool: ThreadPoolExecutor, timeout: float) -> list[int]:
        async with self._stats_lock:  # one stats round at a time
            round_ = lambda: self.ex.free_blocks(timeout=timeout)  # noqa: E731
            return await asyncio.get_running_loop().run_in_executor(pool, round_)

    def error(self, e: Exception, what: str) -> ApiError:
        """An executor error as a client should see it: refused input 400, time-out 504, failure 500."""
        msg = str(e)
        if self.ex.error:
            why = self.ex.error.splitlines()[0]
            return ApiError(500, f"{what} failed: the executor cannot serve ({why})", "server_error",
                            "executor_failed")
        if msg.startswith("timed out"):
            return ApiError(504, f"{what}: {msg}", "timeout_error", "timeout")
        too_long = isinstance(e, KVCacheExhausted) or "exceeds" in msg
        code = "context_length_exceeded" if too_long else "invalid_value"
        return ApiError(400, f"{what} refused: {msg}", "invalid_request_error", code)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._probe.shutdown(wait=False, cancel_futures=True)
