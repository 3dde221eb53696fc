"""ZAP handler of a context rank's control socket: which CurveZMQ keys may connect, and who was turned away.

ZeroMQ asks the ZAP handler of the socket's context (inproc://zeromq.zap.01) about every new CURVE
connection before any message of it is delivered, so a peer whose key is not authorised never reaches the
sender: no Hello is read, no Welcome (NIXL metadata, pool addresses) is sent. `ZapGuard` answers those
questions from a set of public keys loaded once from `curve_authorized_keys_dir`, on one thread whose every
wait is bounded. Refusals are counted (metrics.on_rejected_peer) and logged at WARNING, at most one line per
peer address per LOG_EVERY_S with the number refused since, so a flood cannot flood the log.

Never decides anything from a message's content, never touches the ROUTER socket or the sender's state.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

import zmq
from zmq.utils import z85

from . import metrics
from .config import ConfigError

log = logging.getLogger("kvbridge.auth")

__all__ = ["ZapGuard", "RejectLog", "HandshakeWatch", "LOG_EVERY_S"]

LOG_EVERY_S = 10.0
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_MAX_ADDRESSES = 1024  # rate-limit memory: peers remembered at once (the oldest is forgotten first)


class RejectLog:
    """Rate-limited record of refused peers: one log line per address per `every_s`, plus a count."""

    def __init__(self, what: str, every_s: float = LOG_EVERY_S) -> None:
        self.what, self.every_s = what, every_s
        self._seen: collections.OrderedDict[str, tuple[float, int]] = collections.OrderedDict()
        self.total = 0

    def refused(self, address: str, kind: str, reason: str, now: float | None = None) -> None:
        """Count (metric label `kind`: key / mechanism / sessions / malformed) and maybe log one refusal."""
        now = time.monotonic() if now is None else now
        self.total += 1
        metrics.on_rejected_peer(kind)
        last, quiet = self._seen.pop(address, (-float("inf"), 0))
        if now - last < self.every_s:
            self._seen[address] = (last, quiet + 1)
            return
        more = f"; {quiet} more refused from it in the last {now - last:.0f} s" if quiet else ""
        log.warning("%s refused a peer at %s: %s%s", self.what, address or "?", reason, more)
        self._seen[address] = (now, 0)
        while len(self._seen) > _MAX_ADDRESSES:
            self._seen.popitem(last=False)


def load_authorized(folder: str) -> frozenset[bytes]:
    """The z85 public keys of the certificate files in `folder` (`kvbridge keys`); ConfigError if unreadable."""
    import zmq.auth

    try:
        keys = zmq.auth.load_certificates(folder)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read transceiver.curve_authorized_keys_dir {folder}: {e}") from None
    if not keys:
        log.warning("transceiver.curve_authorized_keys_dir %s holds no public key: no peer can connect", folder)
    return frozenset(k for k, ok in keys.items() if ok)


class ZapGuard:
    """Answers ZAP requests for every socket of `zctx`: CURVE clients with an authorised key pass.

    Args:
        zctx: the ZeroMQ context whose sockets it guards (start it before any socket binds).
        authorized: z85 public keys allowed in.
        what: how refusals name the guarded thing in the log.
    """

    def __init__(self, zctx: zmq.Context, authorized: frozenset[bytes], what: str) -> None:
        self._keys = authorized
        self.rejects = RejectLog(what)
        self._sock = zctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(_ZAP_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvb-zap", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._sock.close(0)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self._sock.poll(100):
                    self._sock.send_multipart(self._answer(self._sock.recv_multipart()))
            except zmq.ZMQError as e:  # the context is going away
                if not self._stop.is_set():
                    log.error("ZAP handler stopped: %s", e)
                return

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        if len(frames) < 6 or frames[0] != b"1.0":
            self.rejects.refused("?", "malformed", "malformed ZAP request")
            rid = frames[1] if len(frames) > 1 else b""
            return [b"1.0", rid, b"400", b"Malformed request", b"", b""]
        _, rid, _domain, address, _identity, mechanism = frames[:6]
        creds = frames[6:]
        addr = address.decode("utf-8", "replace")[:64]
        if mechanism != b"CURVE" or len(creds) != 1 or len(creds[0]) != 32:
            self.rejects.refused(addr, "mechanism", f"mechanism {mechanism.decode('ascii', 'replace')[:16]} (CURVE required)")
            return [b"1.0", rid, b"400", b"CURVE required", b"", b""]
        key = z85.encode(creds[0])
        if key not in self._keys:
            self.rejects.refused(addr, "key", f"CURVE key {key.decode()[:8]}... is not in curve_authorized_keys_dir")
            return [b"1.0", rid, b"400", b"Unknown key", b"", b""]
        return [b"1.0", rid, b"200", b"OK", key, b""]


class HandshakeWatch:
    """Refusals ZAP never sees: a peer that fails the CurveZMQ handshake itself (a plain, unauthenticated
    peer: mechanism mismatch) is dropped by libzmq before any ZAP request. This watches the guarded socket's
    monitor and records each such failure in `rejects` (logged rate-limited, counted as `mechanism`). Read
    `socket` from the thread that owns the guarded socket (register it in that thread's poller)."""

    EVENTS = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL

    def __init__(self, guarded: zmq.Socket, rejects: RejectLog) -> None:
        self._guarded, self.rejects = guarded, rejects
        self.socket = guarded.get_monitor_socket(self.EVENTS)

    def drain(self) -> None:
        """Record every handshake failure waiting on the monitor (never blocks)."""
        from zmq.utils.monitor import recv_monitor_message

        for _ in range(256):
            try:
                ev = recv_monitor_message(self.socket, zmq.NOBLOCK)
            except zmq.Again:
                return
            where = ev.get("endpoint", b"")
            where = where.decode("utf-8", "replace")[:64] if isinstance(where, bytes) else str(where)[:64]
            self.rejects.refused(f"{where} (peer address not known)", "mechanism",
                                 f"failed the CurveZMQ handshake (not CURVE, or a malformed greeting; code "
                                 f"{ev.get('value')})")

    def close(self) -> None:
        try:
            self._guarded.disable_monitor()
        except zmq.ZMQError:
            pass
        self.socket.close(0)
