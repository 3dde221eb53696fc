"""The rendezvous store of the gloo/nccl agents' process groups, reached only over a proven connection.

A torch process group finds its peer through a c10d Store. torch's TCPStore serves whoever reaches its port,
and lists its keys: a stranger on the network learns each pair's prefix and can set rank 1's address before
the real requester does, and the serving agent would then send the KV it was asked for to the stranger. So
kvbridge opens no store port. The serving agent keeps each pair's keys in an in-process `HashStore` (its own
process group uses it directly); the requester reaches them over a second connection to the agent's own
listener, which answers the same challenge as every other connection (conn_wire.py, "proof") and names its
pair in its HELLO (dist_connection.py). The requester's side is `RemoteStore`, a Python c10d Store whose
every call is one request and one answer on that connection, under a lock and a deadline.

Frames (little-endian), nothing from the peer is evaluated:
    request   op u8, pad, key bytes u16, value bytes u32, timeout ms u32;  then key, then value
              (CHECK and WAIT: the keys joined by NUL; ADD: value int64; COMPARE_SET: expected bytes u32,
              expected, desired)
    answer    status u8 (OK, MISSING: a GET/WAIT that timed out, ERROR: text), pad, bytes u32;  then the bytes
Bounded: MAX_KEY bytes of keys, MAX_VALUE bytes of value, MAX_KEYS keys in one pair's store, waits of at
most MAX_WAIT s (sliced, so stop() ends them); a frame outside them ends the connection.
"""

from __future__ import annotations

import functools
import struct
import threading
import time
from datetime import timedelta

import numpy as np

from ..errors import ConnectionFailed, ProtocolError
from .connection import Connection

__all__ = ["remote_store", "serve_store", "new_store"]

_REQ = struct.Struct("<BxHII")
_ANS = struct.Struct("<BxxxI")
SET, GET, ADD, CHECK, WAIT, COMPARE_SET, DELETE, NUM_KEYS = range(1, 9)
OK, MISSING, ERROR = range(3)
MAX_KEY, MAX_VALUE, MAX_KEYS, MAX_WAIT = 4096, 1 << 20, 1024, 600.0
SLICE = 0.2
_NAMES = {SET: "set", GET: "get", ADD: "add", CHECK: "check", WAIT: "wait", COMPARE_SET: "compare_set",
          DELETE: "delete_key", NUM_KEYS: "num_keys"}


def new_store(timeout: float):
    """The serving side's store of one pair: in-process and C++ (its group's calls never enter Python)."""
    from torch.distributed import HashStore

    store = HashStore()
    store.set_timeout(timedelta(seconds=timeout))
    return store


def _buf(raw: bytes) -> np.ndarray:
    return np.frombuffer(bytearray(raw), np.uint8)


def _recv(conn: Connection, n: int, deadline: float) -> bytes:
    if n == 0:
        return b""
    buf = np.empty(n, dtype=np.uint8)
    conn.recv(buf, deadline)
    return buf.tobytes()


# --- the serving side ------------------------------------------------------------------------------------
def serve_store(conn: Connection, store, stopping: threading.Event, io_timeout: float) -> None:
    """Answer one requester's store calls on `conn` against `store` until it closes or `stopping` is set.
    Raises ProtocolError on a frame outside the bounds, ConnectionFailed when the connection fails."""
    while not stopping.is_set():
        if not conn.poll(SLICE):
            continue
        deadline = time.monotonic() + io_timeout
        op, nkey, nvalue, timeout_ms = _REQ.unpack(_recv(conn, _REQ.size, deadline))
        if op not in _NAMES or nkey > MAX_KEY or nvalue > MAX_VALUE:
            raise ProtocolError(f"store request: op {op}, {nkey} key bytes, {nvalue} value bytes (bounds: "
                                f"ops 1-8, {MAX_KEY}, {MAX_VALUE})")
        key, value = _recv(conn, nkey, deadline), _recv(conn, nvalue, deadline)
        try:
            keys = key.decode("utf-8").split("\0")
        except UnicodeDecodeError:
            raise ProtocolError("store request: a key is not UTF-8") from None
        status, out = _answer(store, op, keys, value, min(timeout_ms / 1e3, MAX_WAIT), stopping)
        conn.send(_buf(_ANS.pack(status, len(out)) + out), time.monotonic() + io_timeout)


def _answer(store, op: int, keys: list[str], value: bytes, wait_s: float,
            stopping: threading.Event) -> tuple[int, bytes]:
    key = keys[0]
    try:
        if op in (SET, ADD, COMPARE_SET) and not store.check([key]) and store.num_keys() >= MAX_KEYS:
            return ERROR, f"the pair's store holds {MAX_KEYS} keys already".encode()
        if op == SET:
            store.set(key, value)
            return OK, b""
        if op == ADD:
            if len(value) != 8:
                return ERROR, b"add: the amount is not 8 bytes"
            return OK, struct.pack("<q", store.add(key, struct.unpack("<q", value)[0]))
        if op == CHECK:
            return OK, b"\1" if store.check(keys) else b"\0"
        if op == COMPARE_SET:
            if len(value) < 4 or struct.unpack_from("<I", value)[0] > len(value) - 4:
                return ERROR, b"compare_set: malformed expected/desired"
            n = struct.unpack_from("<I", value)[0]
            return OK, bytes(store.compare_set(key, value[4:4 + n], value[4 + n:]))
        if op == DELETE:
            return OK, b"\1" if store.delete_key(key) else b"\0"
        if op == NUM_KEYS:
            return OK, struct.pack("<q", store.num_keys())
        # GET and WAIT: wait in slices (stop() ends them) until the keys are there or the time is up
        until = time.monotonic() + wait_s
        while not store.check(keys if op == WAIT else [key]):
            if stopping.is_set() or time.monotonic() >= until:
                return MISSING, b""
            time.sleep(min(2e-3, max(0.0, until - time.monotonic())))
        return OK, (bytes(store.get(key)) if op == GET else b"")
    except (RuntimeError, ValueError) as e:
        return ERROR, f"{_NAMES[op]}: {e}".encode()[:4096]


# --- the requester's side ---------------------------------------------------------------------------------
def remote_store(conn: Connection, timeout: float):
    """A c10d Store (a Python subclass of torch's) whose calls go to the serving agent's pair store over
    `conn`, a proven connection; `timeout` bounds a get or wait, as a TCPStore's does."""
    return _remote_class()(conn, timeout)


@functools.cache
def _remote_class():
    """The class, made on first use so that importing this module does not import torch."""
    from torch.distributed import Store

    class _Remote(Store):
        def __init__(self, conn: Connection, timeout: float) -> None:
            super().__init__()
            self._conn, self._timeout, self._lock = conn, float(timeout), threading.Lock()

        def _call(self, op: int, keys: list[str], value: bytes = b"", wait_s: float = 0.0) -> bytes:
            key = "\0".join(keys).encode("utf-8")
            if len(key) > MAX_KEY or len(value) > MAX_VALUE:
                raise ValueError(f"store {_NAMES[op]}: {len(key)} key / {len(value)} value bytes, over the "
                                 "bounds")
            frame = _REQ.pack(op, len(key), len(value), int(min(wait_s, MAX_WAIT) * 1e3)) + key + value
            with self._lock:
                deadline = time.monotonic() + wait_s + 10.0
                try:
                    self._conn.send(_buf(frame), deadline)
                    status, n = _ANS.unpack(_recv(self._conn, _ANS.size, deadline))
                    if n > MAX_VALUE + MAX_KEY:
                        raise ProtocolError(f"store answer of {n} bytes")
                    out = _recv(self._conn, n, deadline)
                except (ConnectionFailed, ProtocolError) as e:
                    raise RuntimeError(f"the peer's rendezvous store: {e}") from None
            if status == OK:
                return out
            if status == MISSING:
                raise RuntimeError(f"timed out after {wait_s:g} s waiting for {keys} in the peer's "
                                   "rendezvous store")
            raise RuntimeError(f"the peer's rendezvous store refused {_NAMES[op]}: "
                               f"{out.decode('utf-8', 'replace')}")

        def set(self, key, value):
            self._call(SET, [key], value.encode() if isinstance(value, str) else bytes(value))

        def get(self, key):
            return self._call(GET, [key], wait_s=self._timeout)

        def add(self, key, value):
            return struct.unpack("<q", self._call(ADD, [key], struct.pack("<q", int(value))))[0]

        def compare_set(self, key, expected, desired):
            exp = expected.encode() if isinstance(expected, str) else bytes(expected)
            des = desired.encode() if isinstance(desired, str) else bytes(desired)
            return self._call(COMPARE_SET, [key], struct.pack("<I", len(exp)) + exp + des)

        def check(self, keys):
            return self._call(CHECK, list(keys)) == b"\1"

        def wait(self, keys, timeout=None):
            s = self._timeout if timeout is None else timeout.total_seconds()
            self._call(WAIT, list(keys), wait_s=s)

        def delete_key(self, key):
            return self._call(DELETE, [key]) == b"\1"

        def num_keys(self):
            return struct.unpack("<q", self._call(NUM_KEYS, [""]))[0]

        def set_timeout(self, timeout):
            self._timeout = timeout.total_seconds()

    return _Remote
