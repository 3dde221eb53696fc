"""The cuda_ipc agent's transfer handles: one posted copy kernel (`CudaIpcTransfer`), pipelined parts on one
stream (`CudaIpcChunked`), and how a wait notices the end without a blocking synchronize (`_await_end`).

Never does: a blocking synchronize (a wait sleeps through the copy's shortest possible time, then polls the
event against its deadline), or recycle a slot whose kernel may still run.
"""

from __future__ import annotations

import os
import threading
import time

from . import cuda_driver as drv
from .base import TransferHandle, XferState
from .cuda_engine import NOT_READY, Engine, Slot
from .handles import ChunkedTransfer

_FAST_NVLINK = 400e9  # bytes/s no intra-node copy beats: `wait` sleeps through most of the expected time
# `wait` wakes this long before the earliest possible end: time.sleep overshoots by the timer slack (50-80 us
# on the GPU hosts, also for sleep(0)), so it must wake early and then poll without sleeping.
_WAKE_EARLY = 250e-6
_SPIN_S = 2e-3  # ... for at most this long (then the base class's polling, which sleeps between polls)


def _await_end(h: TransferHandle, deadline: float) -> None:
    """Sleep through most of the time `h`'s copy must take at best, then poll its state without sleeping
    (os.sched_yield lets other threads run) until it is no longer PENDING, `_SPIN_S` passes, or the deadline."""
    now = time.monotonic()
    ahead = h.nbytes / _FAST_NVLINK - (now - h.posted_at) - _WAKE_EARLY
    if ahead > 0:
        time.sleep(min(ahead, max(0.0, deadline - now)))
    stop = min(deadline, time.monotonic() + _SPIN_S)
    while h.state() is XferState.PENDING and time.monotonic() < stop:
        os.sched_yield()


class CudaIpcTransfer(TransferHandle):
    """One posted copy kernel; `state()` queries its CUDA event (never blocks)."""

    peak_bps = _FAST_NVLINK

    def __init__(self, engine: Engine | None, slot: Slot | None, ndesc: int, nbytes: int) -> None:
        super().__init__(ndesc, nbytes)
        self._engine, self._slot = engine, slot
        self._final: XferState | None = XferState.DONE if slot is None else None
        self._cancelled = False
        self.gpu_seconds: float | None = None  # set when DONE if the agent was made with timing=True
        self._mu = threading.Lock()

    def state(self) -> XferState:
        if self._final is not None:
            return self._final
        with self._mu:
            return self._poll()

    def _poll(self) -> XferState:
        if self._final is not None or self._slot is None:
            return self._final or XferState.FAILED
        err = self._slot.query()
        if err == NOT_READY:
            return XferState.PENDING
        if err == 0 and not self._cancelled:
            self._final = XferState.DONE
            if self._slot.start is not None:
                self.gpu_seconds = self._slot.elapsed()
        else:
            self._final = XferState.FAILED
            self.error = ("cancelled" if err == 0
                          else f"the copy kernel failed: {drv.error_name(drv.load()[0], err)}")
        slot, self._slot = self._slot, None
        self._engine.recycle(slot, done=True)
        return self._final

    def wait(self, timeout: float, poll_interval: float = 0.0) -> None:
        """Block until DONE; TransferFailed if it failed, TransferTimeout once `timeout` seconds pass.

        Sleeps through most of the time the copy must take at best (bytes / 400 GB/s), then polls the event
        without sleeping near the end (`_await_end`), then like the base class. Never waits past the deadline.
        """
        deadline = time.monotonic() + max(0.0, float(timeout))
        if self._final is None and poll_interval == 0.0:
            _await_end(self, deadline)
        super().wait(max(0.0, deadline - time.monotonic()), poll_interval)

    def _cancel(self) -> None:
        self._cancelled = True  # a launched kernel cannot be stopped: FAILED once it has ended

    def _do_release(self) -> None:
        with self._mu:
            slot, self._slot = self._slot, None
        if slot is not None:
            if self._final is None:
                self._final = XferState.FAILED
                self.error = "released before it finished"
            self._engine.recycle(slot, done=slot.query() != NOT_READY)


class CudaIpcChunked(ChunkedTransfer):
    """A READ or WRITE posted as pipelined kernels on one stream: they end in order, so `state()` polls the
    first part not yet seen DONE and stops at a PENDING one (one event query per poll, not one per part), and
    `wait` sleeps and polls like CudaIpcTransfer's for the bytes of all parts. A FAILED part, or all parts
    DONE, is settled by ChunkedTransfer's rules (cancel the rest, FAILED once none can still move data)."""

    peak_bps = _FAST_NVLINK

    def __init__(self, parts: list[TransferHandle]) -> None:
        super().__init__(parts)
        self.posted_at = parts[0].posted_at
        self._seen = 0  # parts[:_seen] were DONE (final): a lower bound, so a racing poll is harmless

    def state(self) -> XferState:
        i, parts = self._seen, self._parts
        while i < len(parts):
            st = parts[i].state()
            if st is XferState.PENDING:
                self._seen = max(self._seen, i)
                return XferState.PENDING
            if st is not XferState.DONE:
                break
            i += 1
        return super().state()

    def wait(self, timeout: float, poll_interval: float = 0.0) -> None:
        deadline = time.monotonic() + max(0.0, float(timeout))
        if poll_interval == 0.0:
            _await_end(self, deadline)
        super().wait(max(0.0, deadline - time.monotonic()), poll_interval)
