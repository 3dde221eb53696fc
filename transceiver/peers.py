"""A generation rank's context peers: one DEALER socket and one session per context rank endpoint.

Owns the peers' sockets: opening one (with a Hello) when a pull needs the endpoint, sending without
blocking (a loop turn's frames to one peer as one message: outbox.py), closing one on reset, the silence
and connection watch and the heartbeats. Owned by the Receiver's I/O thread only (no locking). Never
touches a pull: what to fail when a peer falls silent or its connection is lost, and which requests a
heartbeat renews, the Receiver says (callables).
"""

from __future__ import annotations

import logging
import uuid
from typing import Callable, Iterator

import zmq
from zmq.utils.monitor import recv_monitor_message

from . import messages as m
from .config import TransceiverConfig
from .ctx_peer import CtxPeer, PeerState
from .outbox import Outbox
from .sockets import make_dealer

log = logging.getLogger("kvbridge.transceiver.receiver")

__all__ = ["CtxPeers"]

_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
_MONITOR_S = 0.1  # how often the sockets' connection events are read (off the per-message path)


class CtxPeers:
    """The context peers of one generation rank, by endpoint.

    Args:
        zctx: the receiver's ZeroMQ context.
        config: peer_timeout_s and the CurveZMQ keys.
        hello: the Hello frame this rank sends every context rank (the same for all).
        ident_prefix: the start of every DEALER identity ("<instance>:<rank>").
    """

    def __init__(self, zctx: zmq.Context, config: TransceiverConfig, hello: bytes, ident_prefix: str) -> None:
        self._zctx, self._config, self._hello, self._prefix = zctx, config, hello, ident_prefix
        self._by_endpoint: dict[str, CtxPeer] = {}
        self._poller: zmq.Poller | None = None
        self._outbox = Outbox(self._send_parts)  # frames of this loop turn, by endpoint: `flush` sends them
        self._polled: tuple = ()
        self._socks: dict[zmq.Socket, CtxPeer] | None = None  # open sockets -> peers; None: one opened or closed
        self._monitor_at = 0.0  # when the connection events are read next

    def __iter__(self) -> Iterator[CtxPeer]:
        return iter(self._by_endpoint.values())

    def poller(self, wake: int) -> zmq.Poller:
        """A poller of `wake` (the I/O thread's wake fd) and every open peer socket's raw descriptor (ZMQ_FD:
        readable when the socket's state may have changed; `readable` says whether a frame waits), rebuilt only
        when a socket opened or closed. Polled by descriptor, never by socket, so another thread's turn
        (Receiver._inline) may use the sockets meanwhile."""
        socks = self._socks
        if socks is None or self._poller is None:
            socks = self._socks = {p.sock: p for p in self._by_endpoint.values() if p.sock is not None}
            if self._poller is None or tuple(socks) != self._polled:
                self._poller, self._polled = zmq.Poller(), tuple(socks)
                for fd in (wake, *(s.getsockopt(zmq.FD) for s in socks)):
                    self._poller.register(fd, zmq.POLLIN)
        return self._poller

    @property
    def changed(self) -> bool:
        """A socket opened or closed since `poller` was last built."""
        return self._socks is None

    def readable(self) -> list[CtxPeer]:
        """Peers with a frame waiting on their socket (ZMQ_EVENTS)."""
        return [p for p in self._by_endpoint.values() if _has_input(p)]

    def input_waiting(self) -> bool:
        """Whether any open socket has a frame waiting. Asked after sending: a send may take the descriptor's
        signal of a frame that came meanwhile, so a loop that then slept on the descriptor would not wake."""
        return any(_has_input(p) for p in self._by_endpoint.values())

    def get(self, endpoint: str) -> CtxPeer | None:
        return self._by_endpoint.get(endpoint)

    def ensure(self, endpoint: str, now: float) -> CtxPeer:
        """The peer at `endpoint`, with a Hello (re)sent when one is due (CtxPeer.hello_due)."""
        peer = self._by_endpoint.get(endpoint)
        if peer is None:
            peer = self._by_endpoint[endpoint] = CtxPeer(endpoint)
        if peer.hello_due(now):
            if peer.sock is None:
                ident = f"{self._prefix}:{uuid.uuid4().hex[:6]}".encode()
                peer.sock = make_dealer(self._zctx, self._config, endpoint, ident)
                peer.monitor = peer.sock.get_monitor_socket(_EVENTS)
                self._socks = None
            self.send(peer, self._hello)
            peer.hello_sent(now)
        return peer

    def send(self, peer: CtxPeer, frame: bytes) -> None:
        """Queue `frame` for `peer`; it leaves with the others of this loop turn (`flush`)."""
        if peer.sock is None:  # reset after silence or an error; its context rank's lease covers the rest
            return
        self._outbox.add(peer.endpoint, frame)

    def flush(self) -> None:
        """The loop turn's end: send every peer what was queued for it, as one message."""
        self._outbox.flush()

    def _send_parts(self, endpoint: str, frames: list[bytes]) -> None:
        peer = self._by_endpoint.get(endpoint)
        if peer is None or peer.sock is None:
            return
        try:
            peer.sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError as e:  # queue full: the deadline covers retries
            log.debug("send to %s failed: %s", peer.endpoint, e)

    def reset(self, peer: CtxPeer) -> None:
        """Drop a peer's socket and session (queued stale frames go with it); the next use re-handshakes."""
        self._outbox.drop(peer.endpoint)
        _close(peer)
        peer.forget()
        self._socks = None

    def watch(self, now: float, gone: Callable[[tuple[int, int], str], None]) -> None:
        """Peers with traffic in flight silent for peer_timeout_s, or whose connection dropped and has not come
        back within handshake_timeout_s (a context process that exited: its kernel closed the connection and
        refuses new ones): `gone(leg, why)` for each of their legs ((request_id, ctx_rank)), then reset."""
        if now >= self._monitor_at:
            self._monitor_at = now + _MONITOR_S
            self._read_events(now)
        for peer in self._by_endpoint.values():
            if not peer.legs:
                continue
            why = ""
            if now - peer.last_heard > self._config.peer_timeout_s:
                why = f"context rank at {peer.endpoint} silent for {now - peer.last_heard:.1f} s"
            elif peer.lost_at and now - peer.lost_at > self._config.handshake_timeout_s:
                why = (f"context rank at {peer.endpoint}: its connection dropped {now - peer.lost_at:.1f} s ago "
                       f"and did not come back within handshake_timeout_s ({self._config.handshake_timeout_s:g} "
                       "s): its process exited, or the network between us is down")
            if why:
                for leg in list(peer.legs):
                    gone(leg, why)
                peer.legs.clear()
                self.reset(peer)

    def heartbeat(self, now: float, renew: Callable[[CtxPeer], list[int]]) -> None:
        """A Heartbeat to every peer: the context request ids `renew(peer)` names, or empty now and then so an
        idle session stays; an idle peer that stopped answering is reset (re-handshakes on use)."""
        timeout = self._config.peer_timeout_s
        for peer in self._by_endpoint.values():
            if peer.sock is None:
                continue
            ids = renew(peer)
            if not ids and peer.state is PeerState.READY and now - peer.last_heard > 2 * timeout:
                self.reset(peer)
                continue
            if ids or (peer.state is PeerState.READY and now - peer.last_sent >= timeout / 3):
                peer.last_sent = now
                self.send(peer, m.Heartbeat(ids).encode())

    def _read_events(self, now: float) -> None:
        """Each open socket's connection events since the last look: a disconnect marks the peer lost (since
        the first one), a connect clears it (ZeroMQ reconnects by itself; the session survives a blip)."""
        for peer in self._by_endpoint.values():
            while peer.monitor is not None:
                try:
                    event = recv_monitor_message(peer.monitor, zmq.NOBLOCK)["event"]
                except zmq.Again:
                    break
                if event == zmq.EVENT_DISCONNECTED:
                    peer.lost_at = peer.lost_at or now
                elif event == zmq.EVENT_CONNECTED:
                    peer.lost_at = 0.0

    def close(self) -> None:
        for peer in self._by_endpoint.values():
            _close(peer)


def _has_input(peer: CtxPeer) -> bool:
    return peer.sock is not None and bool(peer.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)


def _close(peer: CtxPeer) -> None:
    """Close a peer's socket and its event monitor (the caller then forgets them)."""
    if peer.sock is not None:
        if peer.monitor is not None:
            peer.sock.disable_monitor()
            peer.monitor.close(0)
        peer.sock.close(0)
