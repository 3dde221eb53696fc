"""Handles: a registration and a posted transfer, both released explicitly (a finalizer warns, never crashes),
and the composite handle of a transfer posted in pipelined chunks.

Owns the handle side of the TransferAgent contract (`base.py` owns the agent side and imports this module,
never the other way round). The thread rules: `state()` and `cancel()` may be called from any thread, also
at once (a poll must never block; cancel asks, it does not wait); `wait(t)` and `release()` belong to the
handle's owner. Never blocks past a caller's timeout.
"""

from __future__ import annotations

import time
import warnings
from abc import ABC, abstractmethod
from typing import Callable, Protocol

from ..errors import TransferFailed, TransferTimeout
from .memory import MemoryRegion, XferState

__all__ = ["Registration", "TransferHandle", "FutureTransfer", "ChunkedTransfer", "chunk_bounds", "settle_all"]


class RegistrationOwner(Protocol):
    """What a Registration knows of the agent that made it (a TransferAgent, named here without importing
    base.py, which imports this module)."""

    name: str


class _Releasable:
    """Explicit release, idempotent, with a warning (not a crash) when garbage-collected unreleased."""

    _released: bool = True

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._do_release()

    def _do_release(self) -> None:  # pragma: no cover - overridden
        pass

    @property
    def released(self) -> bool:
        return self._released

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:
        if not getattr(self, "_released", True):
            warnings.warn(f"{type(self).__name__} was not released; releasing it now", ResourceWarning,
                          stacklevel=2)
            try:
                self.release()
            except Exception:  # noqa: BLE001 - never raise from a finalizer
                pass


class Registration(_Releasable):
    """A registered memory region; `release()` deregisters it (through the callback its agent gave)."""

    def __init__(self, agent: RegistrationOwner, region: MemoryRegion, key: int,
                 on_release: "Callable[[Registration], None]") -> None:
        self.agent = agent
        self.region = region
        self.key = key
        self._on_release = on_release
        self._released = False

    def _do_release(self) -> None:
        self._on_release(self)

    def __repr__(self) -> str:
        return f"Registration({self.region}, released={self._released})"


class TransferHandle(_Releasable, ABC):
    """One posted READ or WRITE. Poll `state()`, or `wait(timeout)`; always `release()` it."""

    peak_bps: float = 0.0  # bytes/s no transfer of this kind beats (0: unknown); see `earliest_end`

    def __init__(self, num_descriptors: int, nbytes: int) -> None:
        self.num_descriptors = num_descriptors
        self.nbytes = nbytes
        self.error: str | None = None
        self.posted_at = time.monotonic()
        self._released = False
        # (start, end) in microseconds on the transport's own clock, where it times its transfers (NIXL's
        # telemetry: postXferReq -> completion seen); None otherwise. Set once the handle is DONE.
        self.transport_span: tuple[float, float] | None = None

    @abstractmethod
    def state(self) -> XferState:
        """PENDING, DONE or FAILED; never blocks. After FAILED, `error` says why."""

    def earliest_end(self) -> float | None:
        """The `time.monotonic()` before which this transfer cannot be DONE (posted + bytes at `peak_bps`), for a
        poller that looks more often near the end; None where the transport gives no such bound."""
        return self.posted_at + self.nbytes / self.peak_bps if self.peak_bps > 0 else None

    def cancel(self) -> bool:
        """Abort the transfer if it is still running (best effort); True if it was PENDING and was asked to stop.

        The state becomes FAILED once nothing can still move for this transfer: at once where the transport
        can stop it, or when data already in flight has landed (NIXL). Until then it stays PENDING, so a
        caller that waits for a non-PENDING state never frees memory a transfer can still write."""
        if self.state() is not XferState.PENDING:
            return False
        self._cancel()
        self.error = self.error or "cancelled"
        return True

    def _cancel(self) -> None:  # pragma: no cover - overridden where the transport can abort
        pass

    def wait(self, timeout: float, poll_interval: float = 0.0) -> None:
        """Block until DONE; raise TransferFailed if it fails, TransferTimeout once `timeout` seconds pass.

        Args:
            timeout: seconds to wait at most (required: no unbounded waits in kvbridge).
            poll_interval: seconds to sleep between polls; 0 spins with a yield (lowest latency).
        """
        deadline = time.monotonic() + max(0.0, float(timeout))
        spins = 0
        while True:
            st = self.state()
            if st is XferState.DONE:
                return
            if st is XferState.FAILED:
                raise TransferFailed(f"transfer of {self.nbytes} bytes in {self.num_descriptors} descriptors "
                                     f"failed: {self.error or 'backend reported an error'}")
            if time.monotonic() >= deadline:
                raise TransferTimeout(f"transfer of {self.nbytes} bytes in {self.num_descriptors} descriptors "
                                      f"not done after {timeout:.3g} s")
            spins += 1
            if poll_interval > 0:
                time.sleep(poll_interval)
            elif spins > 1000:
                time.sleep(50e-6)  # back off after a burst of spinning; keeps the GIL available
            else:
                time.sleep(0)

    def _do_release(self) -> None:
        pass


def chunk_bounds(n: int, chunk: int, grow: bool = False) -> list[int]:
    """End offsets of pipelined chunks: a first chunk of chunk/8 (data moves early), then `chunk` each.

    With `grow` the parts double from chunk/8 up to `chunk` (chunk/8, chunk/4, chunk/2, chunk, chunk, ...): each
    part's host work (about proportional to its size) then fits under the copy of the part before, which is at
    least half its size. A tail under half the next size joins the part before it; a joined tail over `chunk`
    goes out as two halves. No part is over `chunk`.
    """
    first = max(1, chunk // 8)
    if not grow:
        return [first] + list(range(first + chunk, n, chunk)) + [n] if n > first else [n]
    out, a, size = [], 0, first
    while True:
        nxt = min(2 * size, chunk)
        if n - a - size < max(1, nxt // 2):  # what would follow this part is small: end here
            rest = n - a
            if rest > chunk:
                out.append(a + rest // 2)
            out.append(n)
            return out
        a += size
        out.append(a)
        size = nxt


def settle_all(parts: list["TransferHandle"], timeout: float = 30.0) -> None:
    """Cancel posted parts and wait (bounded) until none is still moving data, then release them."""
    for h in parts:
        h.cancel()
    deadline = time.monotonic() + timeout
    for h in parts:
        while h.state() is XferState.PENDING and time.monotonic() < deadline:
            time.sleep(0.001)
        h.release()


class ChunkedTransfer(TransferHandle):
    """One transfer posted as several parts; DONE when all are. When one fails the others are cancelled, and
    the whole is FAILED only once none of them can still move data (a part still running stays PENDING): a
    caller that reuses the memory after FAILED must never see a late part land in it."""

    def __init__(self, parts: list[TransferHandle]) -> None:
        super().__init__(sum(p.num_descriptors for p in parts), sum(p.nbytes for p in parts))
        self._parts = parts
        self._stopping = False

    def state(self) -> XferState:
        pending = failed = False
        for p in self._parts:
            st = p.state()
            if st is XferState.FAILED:
                failed = True
                self.error = self.error or p.error
            pending |= st is XferState.PENDING
        if failed and pending and not self._stopping:
            self._stopping = True
            self._cancel()  # the rest stop (or land) so the whole can settle
        if pending:
            return XferState.PENDING
        return XferState.FAILED if failed else XferState.DONE

    @property
    def transport_span(self) -> tuple[float, float] | None:  # type: ignore[override]
        """The parts' spans joined (first start, last end), when every part has one."""
        spans = [p.transport_span for p in self._parts]
        if not spans or any(x is None for x in spans):
            return None
        return min(a for a, _ in spans), max(b for _, b in spans)

    @transport_span.setter
    def transport_span(self, _value) -> None:  # the base __init__ sets None; the parts hold the spans
        pass

    def _cancel(self) -> None:
        for p in self._parts:
            p.cancel()

    def _do_release(self) -> None:
        for p in self._parts:
            p.release()


class FutureTransfer(TransferHandle):
    """A transfer run as a job on a thread pool (a `concurrent.futures.Future`): for agents whose transport
    is a blocking call. PENDING while the job runs; FAILED with the job's exception, when cancelled before it
    started, or when it ended after cancel() was asked (`on_cancel` may make a running job stop early)."""

    def __init__(self, fut, num_descriptors: int, nbytes: int, on_cancel=None) -> None:
        super().__init__(num_descriptors, nbytes)
        self._fut, self._on_cancel, self._cancelled = fut, on_cancel, False

    def state(self) -> XferState:
        if not self._fut.done():
            return XferState.PENDING
        if self._fut.cancelled():
            self.error = "cancelled before it started"
            return XferState.FAILED
        exc = self._fut.exception()
        if exc is not None:
            self.error = str(exc)
            return XferState.FAILED
        if self._cancelled:
            self.error = self.error or "cancelled"
            return XferState.FAILED
        return XferState.DONE

    def _cancel(self) -> None:
        self._cancelled = True
        if self._on_cancel is not None:
            self._on_cancel()
        self._fut.cancel()

