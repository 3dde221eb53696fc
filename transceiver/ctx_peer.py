"""A context rank as one generation rank sees it: its DEALER socket, handshake state and what it serves us.

Owns the peer state machine, changed only by `CtxPeer.advance` (table below, rule in fsm.py):

    NEW --Hello sent--> HELLO --Welcome accepted--> READY
    HELLO --Hello sent again (unanswered for a second)--> HELLO
    HELLO | READY --refused (an Error for no request, a Welcome we cannot use)--> FAILED --Hello again--> HELLO
    any --reset (silence, "no session", a connection lost and not back)--> NEW

Pure state, owned and changed only by the Receiver's I/O thread (receiver.py); nothing here sends, receives
or closes a socket (the receiver closes `sock` before `forget()`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import zmq

from ..formatter.planner import RankPool
from . import messages as m
from .fsm import move

__all__ = ["CtxPeer", "PEER_MOVES", "PeerState"]


class PeerState(str, Enum):
    """The session with one context rank."""

    NEW = "new"        # no Hello sent yet (or the socket was reset)
    HELLO = "hello"    # Hello sent, waiting for Welcome
    READY = "ready"    # Welcome accepted: Fetches may go out
    FAILED = "failed"  # refused or unreachable; `error` says why (retried after a second)

    __str__ = str.__str__
    __format__ = str.__format__


PEER_MOVES: dict[PeerState, frozenset[PeerState]] = {
    PeerState.NEW: frozenset({PeerState.HELLO, PeerState.NEW}),
    PeerState.HELLO: frozenset({PeerState.HELLO, PeerState.READY, PeerState.FAILED, PeerState.NEW}),
    # a repeated Welcome re-accepts; an Error for no request (e.g. to a heartbeat) fails the session
    PeerState.READY: frozenset({PeerState.READY, PeerState.FAILED, PeerState.NEW}),
    PeerState.FAILED: frozenset({PeerState.HELLO, PeerState.READY, PeerState.FAILED, PeerState.NEW}),
}


@dataclass
class CtxPeer:
    endpoint: str
    sock: zmq.Socket | None = None
    monitor: zmq.Socket | None = None  # `sock`'s connect / disconnect events (peers.py reads them)
    lost_at: float = 0.0  # when `sock` lost its connection, 0 while connected (or never connected)
    state: PeerState = PeerState.NEW
    error: tuple[str, str] = ("", "")  # (KvBridgeError subclass name, message) of the last refusal
    welcome: m.Welcome | None = None
    remote: RankPool | None = None
    agent_kind: str = ""
    peer_name: str = ""
    hello_at: float = 0.0
    first_hello: float = 0.0
    last_heard: float = 0.0
    last_sent: float = 0.0  # idle peers get an empty heartbeat now and then, so their session stays
    legs: set = field(default_factory=set)  # (request_id, ctx_rank) with traffic in flight

    def advance(self, to: PeerState) -> None:
        """The one place a peer's state changes; IllegalTransition for a move PEER_MOVES does not list."""
        self.state = move(f"context peer {self.endpoint}", PEER_MOVES, self.state, to)

    def hello_due(self, now: float) -> bool:
        """(Re)send Hello when new, when a failure is older than a second, or when a Hello went unanswered for
        a second (Hello is idempotent on the context side)."""
        return self.state is PeerState.NEW or (
            self.state in (PeerState.FAILED, PeerState.HELLO) and now - self.hello_at > 1.0)

    def hello_sent(self, now: float) -> None:
        if self.state is not PeerState.HELLO:
            self.first_hello = now
        self.advance(PeerState.HELLO)
        self.hello_at = self.last_heard = now

    def welcomed(self, w: m.Welcome, remote: RankPool, agent_kind: str, peer_name: str) -> None:
        self.advance(PeerState.READY)
        self.welcome, self.remote, self.agent_kind, self.peer_name = w, remote, agent_kind, peer_name

    def refused(self, error_type: str, error: str) -> None:
        self.advance(PeerState.FAILED)
        self.error = (error_type, error)

    def forget(self) -> None:
        """Back to NEW without socket or session (the caller closed `sock`). The agent keeps knowing the
        peer: reads to it may still be in flight; a new Welcome re-connects it."""
        self.advance(PeerState.NEW)
        self.sock, self.monitor, self.welcome, self.remote = None, None, None, None
        self.lost_at = 0.0
        self.peer_name = self.agent_kind = ""
