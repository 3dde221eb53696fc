"""Per-device machinery of the cuda_ipc agent: its stream, staging slots, and releases deferred behind it.

Owns: one non-blocking CUDA stream per (agent, local device), a pool of slots (pinned staging + device
descriptor table + completion event) reused once their event has completed, and callables deferred until
everything already enqueued on the stream has finished (unmapping a peer's memory, say).

Never frees or reuses a slot whose event has not completed, and never waits on the stream without a
deadline (`drain` polls and gives up, leaking rather than freeing memory a kernel may still use).
"""

from __future__ import annotations

import logging
import threading
import time

from . import cuda_driver as drv
from .cuda_kernels import FragmentCopier, KernelArgs

log = logging.getLogger(__name__)

NOT_READY = 600  # CUDA_ERROR_NOT_READY: the event's work is still running
_MIN_SLOT_WORDS = 1 << 13  # 64 KiB staging at least
_KEEP_SLOTS = 32  # idle slots kept for reuse (pinned allocation costs milliseconds) ...
_KEEP_WORDS = 8 << 20  # ... up to 64 MiB of pinned staging in all


class Slot:
    """What one in-flight transfer owns: pinned staging, the device descriptor table, a completion event, an
    "uploaded" event (the table's copy on the upload stream, which the kernel's stream waits for), the kernel's
    argument block (`args`: made once, filled per launch) and, when
    the agent times transfers, a start event recorded just before the descriptor upload."""

    def __init__(self, dev: drv.Device, words: int, timing: bool) -> None:
        cu, _ = drv.load()
        self.words = words
        self.pinned = drv.PinnedBuffer(words * 8, dev)
        self.table = drv.DeviceBuffer(words * 8, dev)
        self.args = KernelArgs()
        flags = 0 if timing else int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        quiet = int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        with dev.current():
            self.event = drv.check(cu.cuEventCreate(flags), "cuEventCreate")
            self.uploaded = drv.check(cu.cuEventCreate(quiet), "cuEventCreate")
            self.start = drv.check(cu.cuEventCreate(flags), "cuEventCreate") if timing else None
        self._dev = dev

    def elapsed(self) -> float:
        """Seconds between the start and completion events (both must have completed)."""
        with self._dev.current():
            ms = drv.check(drv.load()[0].cuEventElapsedTime(self.start, self.event), "cuEventElapsedTime")
        return float(ms) / 1e3

    def query(self) -> int:
        """0 when the work recorded before the event is done, CUDA_ERROR_NOT_READY (600) while pending."""
        with self._dev.current():
            (err,) = drv.load()[0].cuEventQuery(self.event)
        return int(err)

    @property
    def freed(self) -> bool:
        return not self.pinned.ptr

    def free(self) -> None:
        self.pinned.free()
        self.table.free()
        with self._dev.current():
            drv.load()[0].cuEventDestroy(self.event)
            drv.load()[0].cuEventDestroy(self.uploaded)
            if self.start is not None:
                drv.load()[0].cuEventDestroy(self.start)


class Engine:
    """Per local device: the agent's stream, the kernel, a pool of slots, releases waiting on the stream.

    With `side_upload` the descriptor tables go up on a second stream (`upload`): the kernel's stream waits for
    its own table's event only, so the upload of the next transfer's table overlaps the copy of the current one
    instead of queueing behind it; but when `stream` is idle (`idle()`: the last kernel launched on it has
    ended) there is nothing to overlap, and the upload goes on `stream` ahead of its kernel (no cross-stream
    event: the kernel starts sooner). Without it, (the earlier behaviour) the upload always runs on `stream`.
    Either way `stream` alone orders the kernels, and an event recorded on it after a kernel covers the
    kernel's upload too (the kernel waited for it).
    """

    def __init__(self, dev: drv.Device, timing: bool = False, side_upload: bool = True) -> None:
        cu, _ = drv.load()
        self.dev = dev
        self.timing = timing
        self.copier = FragmentCopier.get(dev)
        flags = int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
        with dev.current():
            self.stream = drv.check(cu.cuStreamCreate(flags), "cuStreamCreate")
            self.upload = drv.check(cu.cuStreamCreate(flags), "cuStreamCreate") if side_upload else None
        self.tail: Slot | None = None  # the slot of the kernel launched last on `stream` (set by the agent)
        self._free: list[Slot] = []
        self._busy: list[Slot] = []  # released by their handles while their kernel may still run
        self._deferred: list[tuple[Slot, object]] = []  # (fence slot, callable) run once the fence is done
        self._lock = threading.Lock()

    def idle(self) -> bool:
        """Whether the kernel launched last on `stream` has ended (its device's context must be current). A
        guess for choosing where an upload goes, never for freeing anything: a slot that was reused since, or
        freed, answers for a kernel at least as late, or ended."""
        t = self.tail
        if t is None or t.freed:
            return True
        (err,) = drv.load()[0].cuEventQuery(t.event)
        return int(err) != NOT_READY

    def acquire(self, words: int) -> Slot:
        with self._lock:
            self._reap()
            fits = [s for s in self._free if s.words >= words]
            if fits:
                slot = min(fits, key=lambda s: s.words)
                self._free.remove(slot)
                return slot
        size = max(_MIN_SLOT_WORDS, 1 << (words - 1).bit_length())
        return Slot(self.dev, size, self.timing)

    def recycle(self, slot: Slot, done: bool) -> None:
        with self._lock:
            (self._free if done else self._busy).append(slot)
            self._reap()

    def defer(self, fn) -> None:
        """Run `fn()` once everything enqueued on the stream so far has finished."""
        slot = self.acquire(1)
        cu, _ = drv.load()
        with self.dev.current():
            drv.check(cu.cuEventRecord(slot.event, self.stream), "cuEventRecord")
        with self._lock:
            self._deferred.append((slot, fn))
            self._reap()

    def _reap(self) -> None:  # under self._lock
        done = [s for s in self._busy if s.query() != NOT_READY]
        for s in done:
            self._busy.remove(s)
            self._free.append(s)
        ready = [(s, fn) for s, fn in self._deferred if s.query() != NOT_READY]
        for s, fn in ready:
            self._deferred.remove((s, fn))
            self._free.append(s)
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - a failed unmap must not break transfers
                log.warning("deferred CUDA release failed: %s", e)
        while len(self._free) > _KEEP_SLOTS or (len(self._free) > 1
                                                 and sum(x.words for x in self._free) > _KEEP_WORDS):
            smallest = min(self._free, key=lambda x: x.words)
            self._free.remove(smallest)  # (list.remove returns None: free the slot itself)
            smallest.free()

    def drain(self, timeout: float) -> bool:
        """Wait (bounded) for the streams to go idle, then free everything; False if they did not in time."""
        cu, _ = drv.load()
        deadline = time.monotonic() + timeout
        streams = [s for s in (self.stream, self.upload) if s is not None]
        with self.dev.current():
            while any(int(cu.cuStreamQuery(s)[0]) == NOT_READY for s in streams):
                if time.monotonic() > deadline:
                    log.warning("cuda_ipc: stream on device %d still busy after %.1f s; leaking its buffers",
                                self.dev.ordinal, timeout)
                    return False
                time.sleep(1e-4)
        with self._lock:
            self._busy, free = [], self._busy + self._free + [s for s, _ in self._deferred]
            fns, self._deferred, self._free = [fn for _, fn in self._deferred], [], []
        for fn in fns:
            fn()
        for s in free:
            s.free()
        with self.dev.current():
            cu.cuStreamDestroy(self.stream)
            if self.upload is not None:
                cu.cuStreamDestroy(self.upload)
        return True
