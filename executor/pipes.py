"""The parent <-> rank process pipes: framed msgpack messages (never pickle) and the rank's inbox thread.

`Pipes` is one pair of one-way multiprocessing connections; `Inbox` drains the parent->rank side on its own
thread so the parent never blocks: commands go to a queue, KV payloads are kept by request id until the
rank's step takes them (bounded waits).
"""

from __future__ import annotations

import queue
import threading
import time

from .. import codec
from ..errors import ExecutorError

__all__ = ["Pipes", "Inbox"]


class Pipes:
    """Framed msgpack messages over a pair of one-way multiprocessing connections (send_bytes/recv_bytes)."""

    def __init__(self, rx, tx) -> None:
        self.rx, self.tx = rx, tx
        self._lock = threading.Lock()

    def send(self, msg: dict, payload: bytes | None = None) -> None:
        with self._lock:
            self.tx.send_bytes(codec.pack(msg))
            if payload is not None:
                self.tx.send_bytes(payload)

    def recv(self, timeout: float) -> tuple[dict, bytes | None] | None:
        """One message (and its payload when the header says `has_payload`), or None on timeout."""
        if not self.rx.poll(timeout):
            return None
        msg = codec.unpack(self.rx.recv_bytes(), what="executor frame")
        if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
            raise ExecutorError(f"executor frame without a type: {msg!r:.200}")
        payload = None
        if msg.get("has_payload"):
            if not self.rx.poll(60):
                raise ExecutorError("executor frame: payload did not follow its header within 60s")
            payload = self.rx.recv_bytes()
        return msg, payload


class Inbox(threading.Thread):
    """Drains the parent->rank pipe so the parent never blocks: commands to a queue, KV payloads by id."""

    def __init__(self, pipes: Pipes) -> None:
        super().__init__(daemon=True, name="kvbridge-inbox")
        self.pipes = pipes
        self.commands: queue.Queue = queue.Queue()
        self.kv: dict[int, tuple[dict, bytes]] = {}
        self.cv = threading.Condition()
        self.closed = False

    def run(self) -> None:
        try:
            while not self.closed:
                got = self.pipes.recv(0.2)
                if got is None:
                    continue
                msg, payload = got
                if msg["t"] == "kv":
                    with self.cv:
                        self.kv[int(msg["rid"])] = (msg, payload or b"")
                        self.cv.notify_all()
                else:
                    self.commands.put(msg)
        except (EOFError, OSError):
            self.commands.put({"t": "stop", "why": "parent closed the pipe"})
        except Exception as e:  # noqa: BLE001 - a bad frame from the parent: the leader stops with the reason
            self.commands.put({"t": "fatal", "msg": f"bad frame from the parent: {type(e).__name__}: {e}"})

    def take_kv(self, rid: int, timeout: float) -> tuple[dict, bytes]:
        deadline = time.monotonic() + timeout
        with self.cv:
            while rid not in self.kv:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ExecutorError(f"write_kv of request {rid}: its KV shard did not arrive in "
                                        f"{timeout:.0f}s")
                self.cv.wait(left)
            return self.kv.pop(rid)
