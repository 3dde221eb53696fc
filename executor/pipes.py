"""The parent <-> rank process pipes: framed msgpack messages (never pickle) and the rank's inbox thread.

`Pipes` is one pair of one-way multiprocessing connections carrying pipe_messages.py's typed messages (it
encodes and decodes them there, strictly); `Inbox` drains the parent->rank side on its own thread so the
parent never blocks: commands go to a queue, KV payloads are kept by request id until the rank's step takes
them (bounded waits). Owns the transport only; never acts on a message.
"""

from __future__ import annotations

import queue
import threading
import time

from typing import Any, Callable

from .. import codec
from ..errors import ExecutorError
from .pipe_messages import Fatal, KvShard, Stop, encode

__all__ = ["Pipes", "Inbox"]


class Pipes:
    """Typed messages over a pair of one-way multiprocessing connections (send_bytes/recv_bytes).

    Args:
        rx, tx: the connections.
        decode: pipe_messages.decode_command (a rank's side) or decode_reply (the parent's side).
    """

    def __init__(self, rx, tx, decode: Callable[[Any], tuple[Any, bool]]) -> None:
        self.rx, self.tx, self.decode = rx, tx, decode
        self._lock = threading.Lock()

    def send(self, msg: Any, payload: bytes | None = None) -> None:
        frame = codec.pack(encode(msg, payload is not None))
        with self._lock:
            self.tx.send_bytes(frame)
            if payload is not None:
                self.tx.send_bytes(payload)

    def recv(self, timeout: float) -> tuple[Any, bytes | None] | None:
        """One message (and its payload when its frame says one follows), or None on timeout.

        Raises ExecutorError (or ProtocolError) naming what was wrong with a bad frame."""
        if not self.rx.poll(timeout):
            return None
        msg, has_payload = self.decode(codec.unpack(self.rx.recv_bytes(), what="executor frame"))
        payload = None
        if has_payload:
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
        self.kv: dict[int, tuple[KvShard, bytes]] = {}
        self.cv = threading.Condition()
        self.closed = False

    def run(self) -> None:
        try:
            while not self.closed:
                got = self.pipes.recv(0.2)
                if got is None:
                    continue
                msg, payload = got
                if isinstance(msg, KvShard):
                    with self.cv:
                        self.kv[msg.rid] = (msg, payload or b"")
                        self.cv.notify_all()
                else:
                    self.commands.put(msg)
        except (EOFError, OSError):
            self.commands.put(Stop("parent closed the pipe"))
        except Exception as e:  # noqa: BLE001 - a bad frame from the parent: the leader stops with the reason
            self.commands.put(Fatal(f"bad frame from the parent: {type(e).__name__}: {e}"))

    def take_kv(self, rid: int, timeout: float) -> tuple[KvShard, bytes]:
        deadline = time.monotonic() + timeout
        with self.cv:
            while rid not in self.kv:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ExecutorError(f"write_kv of request {rid}: its KV shard did not arrive in "
                                        f"{timeout:.0f}s")
                self.cv.wait(left)
            return self.kv.pop(rid)
