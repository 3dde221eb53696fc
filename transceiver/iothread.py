"""The skeleton the Sender and the Receiver share: one I/O thread that owns every socket and every piece of
state, fed by a command queue that any thread may use, woken through an inproc socket pair.

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
        self._wake_rx = zctx.socket(zmq.PAIR)
        self._wake_rx.bind(f"inproc://wake-{id(self)}")
        self._wake_tx = zctx.socket(zmq.PAIR)
        self._wake_tx.connect(f"inproc://wake-{id(self)}")
        self._wake_lock = threading.Lock()
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
        self._worker.shutdown(wait=True, cancel_futures=True)  # no pack/unpack may still touch memory
        self._wake_rx.close(0)
        self._wake_tx.close(0)
        return True

    def _command(self, cmd: object, wake: bool = True) -> None:
        """Queue `cmd` for the I/O thread; `wake=False` leaves it for the loop's next turn (at most one poll
        away, and at once when a frame arrives: the loop takes commands before frames)."""
        if self._stop.is_set():
            raise KvBridgeError(f"{self._what} is closed")
        self._cmds.put(cmd)
        if wake:
            self._wake()

    def _wake(self) -> None:
        with self._wake_lock:
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def _drain_commands(self) -> None:
        while self._wake_rx.poll(0):
            self._wake_rx.recv()
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            self._do_command(cmd)

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
