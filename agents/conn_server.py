"""The serving side of a ConnectionAgent: accepts peers and answers their READ/WRITE requests.

A new connection first gets a challenge and must answer it with the agent's connection key (conn_wire.py),
which only peers handed this agent's metadata know; one that does not is closed before any request is read.

Owns the accept thread and one thread per accepted connection. A request is answered only after every
range in it passed this agent's RegionTable check (kind, device, bounds); otherwise the peer gets an ERROR
response naming the bad descriptor (its transfer fails with TransferFailed) and the connection stays in
step. A malformed frame (bad magic, version, counts) ends that connection, never the agent. Every I/O has
a deadline of `transfer_timeout` from the request's arrival; idle connections are polled in short slices
so that `stop()` ends every thread promptly. Never touches memory while it is being deregistered: requests
are served inside `agent.serving()`, which deregistration waits for, after `agent.check_served`.

What it needs of its agent is the `ServedAgent` protocol below (ConnectionAgent is one); it never imports
conn_agent.py, which imports this module.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import AbstractContextManager
from typing import Protocol

import numpy as np

from ..errors import AgentError, ConnectionClosed, ConnectionFailed, ProtocolError
from . import conn_wire as wire
from .connection import Connection, Listener
from .memory import DescriptorList

__all__ = ["Server", "ServedAgent", "SLICE"]

log = logging.getLogger(__name__)

SLICE = 0.2  # seconds between checks for stop() while idle
PROOF_TIMEOUT = 5.0  # seconds a new connection has to answer the challenge
MAX_UNPROVEN = 64    # connections answering the challenge at once; one more is closed at once (a flood of
                     # strangers costs them, not this process's threads)


class ServedAgent(Protocol):
    """The agent whose registered memory a Server serves (a ConnectionAgent)."""

    name: str
    transfer_timeout: float  # seconds one request may take from its arrival
    connection_key: bytes    # what a new connection must prove it knows (conn_wire.py, proof)

    def serving(self) -> AbstractContextManager[None]:
        """Held while the serving thread touches registered memory; deregistration waits for it."""

    def check_served(self, descs: DescriptorList, what: str) -> None:
        """AgentError naming `what` unless `descs` are registered memory of a kind this agent serves."""


class Server:
    """Accepts connections on `listener` and serves requests against `agent`'s registered memory."""

    def __init__(self, agent: ServedAgent, listener: Listener) -> None:
        self._agent = agent
        self._listener = listener
        self._stopping = threading.Event()
        self._mu = threading.Lock()
        self._conns: dict[int, tuple[Connection, threading.Thread]] = {}
        self._next = 0
        self._unproven = 0
        self._refused_at = 0.0  # when a full challenge queue was last logged
        self._accept_thread = threading.Thread(target=self._accept_loop, daemon=True,
                                               name=f"kvb-accept-{agent.name}")
        self._accept_thread.start()

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                conn = self._listener.accept(SLICE)
            except ConnectionFailed as e:
                if not self._stopping.is_set():
                    log.error("%s: listener failed, no longer serving: %s", self._agent.name, e)
                return
            if conn is None:
                continue
            with self._mu:
                if self._stopping.is_set():
                    conn.close()
                    return
                full = self._unproven >= MAX_UNPROVEN
                if not full:
                    self._unproven += 1
                    key, self._next = self._next, self._next + 1
                    t = threading.Thread(target=self._serve, args=(key, conn), daemon=True,
                                         name=f"kvb-serve-{self._agent.name}-{key}")
                    self._conns[key] = (conn, t)
            if full:
                self._close_unserved(conn, f"{MAX_UNPROVEN} connections are answering the challenge already")
                continue
            try:
                t.start()
            except RuntimeError as e:  # no thread to be had: this connection goes, the agent keeps serving
                with self._mu:
                    self._conns.pop(key, None)
                    self._unproven -= 1
                self._close_unserved(conn, f"no thread for it ({e})")

    def _close_unserved(self, conn: Connection, why: str) -> None:
        conn.close()
        now = time.monotonic()
        if now - self._refused_at > 10.0:  # a flood is logged once per 10 s, not per connection
            self._refused_at = now
            log.warning("%s: closed a new connection at once: %s", self._agent.name, why)

    def _serve(self, key: int, conn: Connection) -> None:
        try:
            try:
                proven = self._proven(conn)
            finally:
                with self._mu:
                    self._unproven -= 1
            if not proven:
                return
            own = conn.service()  # a transport's side channel (gloo/nccl's rendezvous store) serves itself
            if own is not None:
                own(self._stopping)
                return
            while not self._stopping.is_set():
                if conn.poll(SLICE):
                    self._one_request(conn)
        except ConnectionClosed:
            pass  # the peer went away between requests: the normal end of a connection
        except (ConnectionFailed, ProtocolError) as e:
            if not self._stopping.is_set():
                log.warning("%s: dropping a peer connection: %s", self._agent.name, e)
        except Exception:  # noqa: BLE001 - a bug must not take the agent down; log it loudly
            log.exception("%s: unexpected error serving a peer", self._agent.name)
        finally:
            with self._mu:
                self._conns.pop(key, None)
            try:
                conn.close()
            except Exception:  # noqa: BLE001
                pass

    def _proven(self, conn: Connection) -> bool:
        """Challenge a new connection; True once it answered with this agent's key (within PROOF_TIMEOUT)."""
        deadline = time.monotonic() + min(PROOF_TIMEOUT, self._agent.transfer_timeout)
        conn.greet(deadline)
        frame = wire.challenge()
        conn.send(frame, deadline)
        got = np.empty(wire.PROOF_SIZE, dtype=np.uint8)
        conn.recv(got, deadline)
        if wire.proven(self._agent.connection_key, frame, got):
            return True
        log.warning("%s: refused a connection that did not prove it holds this agent's metadata (a caller that "
                    "found the port, not a peer)", self._agent.name)
        return False

    def _one_request(self, conn: Connection) -> None:
        head = np.empty(wire.Request.SIZE, dtype=np.uint8)
        deadline = time.monotonic() + self._agent.transfer_timeout
        conn.recv(head, deadline)
        req = wire.Request.decode(head)
        raw = np.empty(16 * req.ndesc, dtype=np.uint8)
        conn.recv(raw, deadline)
        try:
            descs = wire.decode_descriptors(raw, req)
        except ProtocolError as e:  # framing is intact: refuse this request, keep the connection
            self._refuse(conn, req, str(e), deadline)
            return
        agent = self._agent
        with agent.serving():
            try:
                agent.check_served(descs, f"{req.op_name} requested by a peer of {agent.name!r}")
            except AgentError as e:
                self._refuse(conn, req, str(e), deadline)
                return
            conn.send(wire.Response(wire.OK, req.req_id).encode(), deadline)
            if req.op == wire.READ:
                conn.send_regions(descs, deadline)
            else:
                conn.recv_regions(descs, deadline)
                conn.send(wire.Response(wire.DONE, req.req_id).encode(), deadline)

    @staticmethod
    def _refuse(conn: Connection, req: wire.Request, text: str, deadline: float) -> None:
        body = wire.encode_error(text)
        conn.send(wire.Response(wire.ERROR, req.req_id, body.nbytes).encode(), deadline)
        if body.nbytes:
            conn.send(body, deadline)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop accepting and serving: abort every connection, wait (bounded) for the threads to end."""
        self._stopping.set()
        deadline = time.monotonic() + timeout
        self._accept_thread.join(max(0.0, deadline - time.monotonic()))
        self._listener.close()
        with self._mu:
            live = list(self._conns.values())
        for conn, _ in live:
            conn.abort()
        for _, t in live:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                log.warning("%s: a serving thread is still blocked in I/O after stop; it ends by its "
                            "deadline", self._agent.name)
