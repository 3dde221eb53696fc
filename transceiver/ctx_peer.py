"""A context rank as one generation rank sees it: its DEALER socket, handshake state and what it serves us.

Pure state, owned and changed only by the Receiver's I/O thread (receiver.py); nothing here talks to a socket.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import zmq

from ..formatter.planner import RankPool
from . import messages as m

__all__ = ["CtxPeer", "PeerState"]


class PeerState(str, Enum):
    """The session with one context rank."""

    NEW = "new"        # no Hello sent yet (or the socket was reset)
    HELLO = "hello"    # Hello sent, waiting for Welcome
    READY = "ready"    # Welcome accepted: Fetches may go out
    FAILED = "failed"  # refused or unreachable; `error` says why (retried after a second)

    __str__ = str.__str__
    __format__ = str.__format__


@dataclass
class CtxPeer:
    endpoint: str
    sock: zmq.Socket | None = None
    state: PeerState = PeerState.NEW
    error: tuple[str, str] = ("", "")
    welcome: m.Welcome | None = None
    remote: RankPool | None = None
    agent_kind: str = ""
    peer_name: str = ""
    hello_at: float = 0.0
    first_hello: float = 0.0
    last_heard: float = 0.0
    last_sent: float = 0.0  # idle peers get an empty heartbeat now and then, so their session stays
    legs: set = field(default_factory=set)  # (request_id, ctx_rank) with traffic in flight
