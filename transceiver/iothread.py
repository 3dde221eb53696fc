"""The skeleton the Sender and the Receiver share: one I/O thread that owns every socket and every piece of
state, fed by a command queue that any thread may use, woken through an eventfd (a pipe where there is none).

A command wakes the I/O thread only when it sleeps (or is about to) in its poll (`_wait`): a busy loop takes
queued commands on its next turn anyway, so under load commands cost no wake-up, no system call and no thread
hand-off of their own. The rule that makes this safe (under the GIL, these steps are sequentially consistent):
the loop says it is idle, then looks at the queue, then sleeps; a caller queues, then looks at the flag. Either
the loop sees the command, or the caller sees the flag and wakes it.

A caller may also run a short turn itself instead of waking the loop (`_turn_lock`: whoever holds it owns every
socket and every piece of state; the loop never holds it while it sleeps, and sleeps on the sockets' raw
ZeroMQ file descriptors, never inside a ZeroMQ call that another thread could race). Such a turn may leave work
for the loop: it marks the loop `_stale` and wakes it when it sleeps; the loop, about to sleep, looks at that
flag after saying it is idle (the same rule as for commands), so it never sleeps on a view a caller changed.

Subclasses (Sender, Receiver: this base class IS their loop, so it stays a base class; the work they do
off the loop is held by composition) implement `_loop_once()` (one bounded wait plus the work it found) and
`_do_command(cmd)`, where `cmd` is one of their own frozen command dataclasses, dispatched by type; they may
run slow work (packing, unpacking, hashing) on `self._worker` so the I/O thread keeps answering heartbeats.
Nothing here blocks without a bound: the loop waits at most one poll, close() joins with a timeout. Never
touches a subclass's state: it only hands commands over and runs the loop.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import zmq

from ..errors import KvBridgeError

log = logging.getLogger(__name__)

__all__ = ["IOThread"]


class IOThread:
    """Command queue + wake socket pair + one I/O thread + one worker thread for slow local work."""

    _what = "transceiver"

    def _start_io(self, zctx: zmq.Context, name: str) -> None:
        """Open the command queue, the wake pair and the worker, then start the I/O thread."""
        self._open_io(zctx, name)
        self._thread.start()

    def _open_io(self, zctx: zmq.Context, name: str) -> None:
        """Everything `_start_io` does but starting the thread (`self._thread.start()`): for a subclass whose
        collaborators need the worker before the loop may run."""
        self._zctx = zctx
        if hasattr(os, "eventfd"):
            self._wake_rx = self._wake_tx = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        else:  # pragma: no cover - not Linux
            self._wake_rx, self._wake_tx = os.pipe()
            os.set_blocking(self._wake_rx, False)
            os.set_blocking(self._wake_tx, False)
        self._wake_lock = threading.Lock()  # no wake may write to the fd once _stop_io closed it
        self._wake_open = True
        self._idle = False  # the I/O thread is (about to be) asleep in its poll: commands must wake it
        self._woken = False  # the last poll saw the wake fd readable: `_drain_commands` clears it
        self._turn_lock = threading.Lock()  # held for a loop turn's work (the loop's own, or a caller's inline)
        self._stale = False  # a caller's turn changed what the loop last looked at: it must look again first
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._finished: collections.deque = collections.deque()
        self._finished_cv = threading.Condition()  # signalled with every result: the owner may wait on it
        self._stop = threading.Event()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-work")
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def poll_finished(self) -> list:
        """Results finished since the last call (never blocks)."""
        out = []
        while self._finished:
            out.append(self._finished.popleft())
        return out

    def wait_finished(self, timeout: float) -> bool:
        """Block until a result is waiting for `poll_finished`, at most `timeout` seconds; True if one is.
        Wakes the moment the I/O thread reports one (no polling interval to wait out)."""
        with self._finished_cv:
            return self._finished_cv.wait_for(lambda: bool(self._finished), max(0.0, timeout))

    def _report(self, result: object) -> None:
        """I/O thread: hand a finished result to the owner (`poll_finished`, `wait_finished`)."""
        with self._finished_cv:
            self._finished.append(result)
            self._finished_cv.notify_all()

    def _stop_io(self, timeout: float) -> bool:
        """Stop the I/O thread and the worker; False if already stopped. The caller closes its own sockets."""
        if self._stop.is_set():
            return False
        self._stop.set()
        self._wake()
        self._thread.join(timeout)
        self._turn_lock.acquire(timeout=timeout)  # a caller's turn ends first; then none starts (kept held)
        self._worker.shutdown(wait=True, cancel_futures=True)  # no pack/unpack may still touch memory
        with self._wake_lock:
            self._wake_open = False
            for fd in {self._wake_rx, self._wake_tx}:
                os.close(fd)
        return True

    def _command(self, cmd: object, wake: bool = True) -> None:
        """Queue `cmd` for the I/O thread, waking it if it sleeps; `wake=False` leaves it for the loop's next
        turn even then (at most one poll away, and at once when a frame arrives: the loop takes commands
        before frames)."""
        if self._stop.is_set():
            raise KvBridgeError(f"{self._what} is closed")
        self._cmds.put(cmd)
        if wake and self._idle:
            self._wake()

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_open:
                try:
                    os.write(self._wake_tx, b"\1\0\0\0\0\0\0\0")  # eventfd: +1 (a pipe: one more byte)
                except BlockingIOError:  # a pipe full of wakes: the loop wakes anyway
                    pass

    def _wait(self, poller: zmq.Poller, timeout_ms: float) -> dict:
        """I/O thread: the loop's one blocking wait, on `poller` (which holds `_wake_rx`), at most
        `timeout_ms`; {socket or fd: events} of what is ready. Marked idle meanwhile, so commands wake it."""
        if timeout_ms > 0:
            self._idle = True
            if self._stale or not self._cmds.empty():  # queued (or changed) while we were busy: look now
                timeout_ms = 0
        try:
            ready = dict(poller.poll(timeout_ms))
        finally:
            self._idle = False
        if self._wake_rx in ready:
            self._woken = True
        return ready

    @staticmethod
    def _received(sock: zmq.Socket, limit: int = 256):
        """I/O thread: the messages waiting on `sock` (at most `limit`), received without blocking. Once one is
        handled it asks the socket's EVENTS whether another waits, so a drained socket costs no recv that
        raises zmq.Again (an exception per loop turn). A caller that closes `sock` stops iterating first."""
        for _ in range(limit):
            try:
                yield sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return

    def _try_inline(self) -> bool:
        """Any thread: take the turn lock if nobody holds it (the loop sleeps), for a short turn of the caller's
        own; False (and the loop woken if it sleeps, so what the caller queued is taken) if somebody does. The
        caller runs its turn, then `_end_inline(more)`."""
        if self._turn_lock.acquire(blocking=False):
            return True  # (never after close: `_stop_io` keeps the lock)
        if self._idle:  # another caller's turn holds it while the loop sleeps: the loop takes our command
            self._wake()
        return False

    def _end_inline(self, more: bool) -> None:
        """Release the turn lock after a caller's turn; `more`: the loop must look again (work left for it, or a
        changed set of sockets), at once if it sleeps."""
        if more:
            self._stale = True
        self._turn_lock.release()
        if more and self._idle:
            self._wake()

    def _drain_commands(self) -> None:
        """Run every queued command; clear the wake first if the last poll saw it (a read of the eventfd when it
        was not written would only raise BlockingIOError: one system call and one exception per loop turn)."""
        if self._woken:
            self._woken = False
            try:
                os.read(self._wake_rx, 4096)  # clear the wake (one read empties an eventfd)
            except BlockingIOError:
                pass
        cmds = self._cmds
        while not cmds.empty():  # only this thread takes from the queue: not empty means get_nowait succeeds
            self._do_command(cmds.get_nowait())

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._loop_once()
            except Exception:  # noqa: BLE001 - the I/O thread must survive anything
                log.exception("%s I/O loop error (continuing)", self._what)

    def _loop_once(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def _do_command(self, cmd: object) -> None:  # pragma: no cover - overridden
        raise NotImplementedError
