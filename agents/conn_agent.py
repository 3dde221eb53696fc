"""ConnectionAgent: any two-sided Connection (connection.py) as a full TransferAgent.

Owns the requesting side: one worker thread and one lazily established Connection per peer, a queue of
posted transfers, and their handles. The serving side is conn_server.py. The exchange for one transfer:

    READ   requester: REQUEST(READ) + descriptors     server: checks every range -> OK + send_regions
                      recv_regions into local descs           (or ERROR + text -> TransferFailed)
    WRITE  requester: REQUEST(WRITE) + descriptors    server: checks -> OK (or ERROR + text)
                      send_regions from local descs           recv_regions, then DONE

Remote descriptors are checked by the serving side (authoritative: it knows its current registrations),
so metadata() carries only the serving endpoint. `read`/`write` return at once; the worker runs requests
to one peer in order. Every I/O has the deadline `transfer_timeout` from the request's start; a dead or
silent peer fails the transfer by then (a closed socket fails it at once) and the next transfer gets a
fresh connection. `cancel()` (and `release()` of a pending handle) drops a queued request, or aborts the
connection under a running one; when it returns, the transfer no longer touches local memory.

To add a library: subclass Connection and Listener, then

    class UdsAgent(ConnectionAgent):
        agent_kind = "uds"
        connection_class = UdsConnection
"""

from __future__ import annotations

import collections
import itertools
import logging
import secrets
import threading
import time
from contextlib import contextmanager
from typing import Any, ClassVar

import numpy as np

from ..errors import AgentError, ConnectionFailed, PeerError, ProtocolError, TransferFailed, TransferTimeout
from . import conn_wire as wire
from .base import DescriptorList, MemoryRegion, TransferAgent, TransferHandle, XferState
from .conn_server import Server
from .connection import Connection
from .envelope import field, open_envelope, seal

__all__ = ["ConnectionAgent", "ConnectionTransfer"]

log = logging.getLogger(__name__)
_ids = itertools.count(1)


class _Refused(Exception):
    """The serving side answered ERROR: the transfer fails, the connection stays usable."""


class ConnectionTransfer(TransferHandle):
    """One READ/WRITE posted to a ConnectionAgent. `wait` sleeps on an event (no spinning)."""

    def __init__(self, ndesc: int, nbytes: int, link: "_PeerLink | None" = None) -> None:
        super().__init__(ndesc, nbytes)
        self._link = link
        self._state = XferState.PENDING if link is not None else XferState.DONE
        self._settled = threading.Event()
        self._mu = threading.Lock()
        self._running = False
        self._cancelled = False
        if link is None:
            self._settled.set()

    def state(self) -> XferState:
        return self._state

    def begin(self) -> bool:
        """Called by the peer link's worker before it moves data; False if cancel() came first."""
        with self._mu:
            if self._cancelled:
                return False
            self._running = True
            return True

    def end(self) -> None:
        """Called by the peer link's worker once it no longer touches this transfer's memory."""
        with self._mu:
            self._running = False

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def settle(self, state: XferState, error: str | None = None) -> None:
        """Set the final state (first call wins) and wake `wait`; called by the peer link's worker."""
        with self._mu:
            if self._state is XferState.PENDING:
                self.error = error
                self._state = state
        self._settled.set()

    def _cancel(self) -> None:
        with self._mu:
            self._cancelled = True
            running = self._running
        self.settle(XferState.FAILED, "cancelled")
        if running and self._link is not None:
            self._link.abort_running(self)

    def wait(self, timeout: float, poll_interval: float = 0.0) -> None:
        """Block until DONE; raise TransferFailed if it fails, TransferTimeout once `timeout` seconds pass.

        Args:
            timeout: seconds to wait at most.
            poll_interval: ignored (the wait sleeps on an event); kept for the base signature.
        """
        self._settled.wait(max(0.0, float(timeout)))
        st = self._state
        if st is XferState.DONE:
            return
        if st is XferState.FAILED:
            raise TransferFailed(f"transfer of {self.nbytes} bytes in {self.num_descriptors} descriptors "
                                 f"failed: {self.error}")
        raise TransferTimeout(f"transfer of {self.nbytes} bytes in {self.num_descriptors} descriptors "
                              f"not done after {timeout:.3g} s")

    def _do_release(self) -> None:
        if self._state is XferState.PENDING:
            self.cancel()


class _Request:
    __slots__ = ("op", "local", "remote", "handle")

    def __init__(self, op: str, local: DescriptorList, remote: DescriptorList, handle: ConnectionTransfer):
        self.op, self.local, self.remote, self.handle = op, local, remote, handle


class _PeerLink:
    """The requesting side towards one peer: a queue, a worker thread and (at most) one connection."""

    def __init__(self, agent: "ConnectionAgent", peer: str, endpoint: dict[str, Any], key: bytes) -> None:
        self.agent, self.peer, self.endpoint, self.key = agent, peer, endpoint, key
        self._cv = threading.Condition()
        self._queue: collections.deque[_Request] = collections.deque()
        self._stopping: str | None = None
        self._thread: threading.Thread | None = None
        self._conn: Connection | None = None
        self._running: ConnectionTransfer | None = None

    def submit(self, req: _Request) -> None:
        with self._cv:
            if self._stopping:
                raise PeerError(f"peer {self.peer!r}: {self._stopping}")
            self._queue.append(req)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"kvb-link-{self.agent.name}->{self.peer}")
                self._thread.start()
            self._cv.notify()

    def abort_running(self, handle: ConnectionTransfer) -> None:
        with self._cv:
            conn = self._conn if self._running is handle else None
        if conn is not None:
            conn.abort()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stopping:
                    self._cv.wait(1.0)
                if not self._queue:
                    break
                req = self._queue.popleft()
            self._execute(req)
        self._drop_connection()

    def _execute(self, req: _Request) -> None:
        h = req.handle
        if not h.begin():
            return
        with self._cv:
            self._running = h
        deadline = time.monotonic() + self.agent.transfer_timeout
        try:
            conn = self._connection(deadline)
            if h.cancelled:  # checked after publishing the connection: a racing cancel() aborts it
                raise ConnectionFailed("cancelled")
            self._exchange(conn, req, deadline)
            h.settle(XferState.DONE)
        except _Refused as e:
            h.settle(XferState.FAILED, f"peer {self.peer!r} refused the {req.op}: {e}")
        except (ConnectionFailed, ProtocolError, AgentError) as e:
            h.settle(XferState.FAILED, f"{req.op} with peer {self.peer!r} failed: {e}")
            self._drop_connection()
        except Exception as e:  # noqa: BLE001 - never leave a handle pending because of a bug
            log.exception("%s: unexpected error in a %s to %s", self.agent.name, req.op, self.peer)
            h.settle(XferState.FAILED, f"internal error: {type(e).__name__}: {e}")
            self._drop_connection()
        finally:
            with self._cv:
                self._running = None
            h.end()

    def _connection(self, deadline: float) -> Connection:
        with self._cv:
            conn = self._conn
        if conn is None or conn.aborted:
            self._drop_connection()
            until = min(deadline, time.monotonic() + self.agent.connect_timeout)
            conn = self.agent.connection_class.establish(self.endpoint, until, self.agent.options)
            try:  # the proof the server asks of a new connection (conn_wire.py): its challenge, our answer
                wire.prove(conn, self.key, until)
                conn.answered(self.key)
            except BaseException:
                conn.close()
                raise
            with self._cv:
                self._conn = conn
        return conn

    def _drop_connection(self) -> None:
        with self._cv:
            conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception as e:  # noqa: BLE001
                log.warning("%s: closing a connection to %s failed: %s", self.agent.name, self.peer, e)

    def _exchange(self, conn: Connection, req: _Request, deadline: float) -> None:
        rid = next(_ids)
        op = wire.READ if req.op == "READ" else wire.WRITE
        remote = req.remote
        head = wire.Request(op, remote.kind, remote.device, rid, len(remote), remote.nbytes)
        conn.send(head.encode(), deadline)
        conn.send(wire.encode_descriptors(remote), deadline)
        self._expect(conn, rid, wire.OK, deadline)
        if op == wire.READ:
            conn.recv_regions(req.local, deadline)
        else:
            conn.send_regions(req.local, deadline)
            self._expect(conn, rid, wire.DONE, deadline)

    @staticmethod
    def _expect(conn: Connection, rid: int, status: int, deadline: float) -> None:
        head = np.empty(wire.Response.SIZE, dtype=np.uint8)
        conn.recv(head, deadline)
        resp = wire.Response.decode(head, rid)
        if resp.status == wire.ERROR:
            text = np.empty(resp.detail, dtype=np.uint8)
            if resp.detail:
                conn.recv(text, deadline)
            raise _Refused(wire.decode_error(text) or "no reason given")
        if resp.status != status:
            raise ProtocolError(f"response status {resp.status}, expected {status}")

    def stop(self, reason: str, timeout: float = 5.0) -> None:
        """Fail queued transfers with `reason`, abort the running one, end the worker (bounded wait)."""
        with self._cv:
            self._stopping = reason
            queued, self._queue = list(self._queue), collections.deque()
            running, conn, thread = self._running, self._conn, self._thread
            self._cv.notify_all()
        for req in queued:
            req.handle.settle(XferState.FAILED, reason)
        if running is not None:
            running.settle(XferState.FAILED, reason)
        if conn is not None:
            conn.abort()
        if thread is not None:
            thread.join(timeout)
        if thread is None or not thread.is_alive():
            self._drop_connection()


class ConnectionAgent(TransferAgent):
    """A TransferAgent over a two-sided Connection class. See the module docstring.

    Args:
        name: unique among the peers this agent talks to.
        transfer_timeout: seconds one transfer may take once started (each side's I/O deadline).
        connect_timeout: seconds to establish a connection to a peer.
        **options: passed to the connection class's `listen` and `establish` (e.g. host).
    """

    agent_kind: ClassVar[str] = "abstract-connection"
    connection_class: ClassVar[type[Connection]]

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "connection_class" in cls.__dict__ and "memory_kinds" not in cls.__dict__:
            cls.memory_kinds = cls.connection_class.memory_kinds

    def __init__(self, name: str, *, transfer_timeout: float = 60.0, connect_timeout: float = 10.0,
                 **options: Any) -> None:
        super().__init__(name)
        if not (transfer_timeout > 0 and connect_timeout > 0):
            raise AgentError("transfer_timeout and connect_timeout must be positive seconds")
        self.transfer_timeout = float(transfer_timeout)
        self.connect_timeout = float(connect_timeout)
        self._options = dict(options)
        self.connection_key = secrets.token_bytes(wire.KEY_BYTES)  # a connection's proof (conn_wire.py)
        self._links: dict[str, _PeerLink] = {}
        self._links_lock = threading.Lock()  # not the base lock: deregistration holds that while it waits
        self._serve_cv = threading.Condition()
        self._serving_now = 0
        self._listener = self.connection_class.listen(self._options)
        self._server = Server(self, self._listener)

    # --- memory: the serving side reads/writes registered ranges, guarded against deregistration -------
    def _register(self, region: MemoryRegion, key: int) -> None:
        pass  # nothing to pin: the serving thread copies from/to the addresses

    def _unregister(self, region: MemoryRegion, key: int) -> None:
        with self._serve_cv:
            if not self._serve_cv.wait_for(lambda: self._serving_now == 0, self.transfer_timeout):
                log.warning("%s: deregistered %s while a peer's request was still being served", self.name,
                            region)

    def check_served(self, descs: DescriptorList, what: str) -> None:
        """AgentError naming `what` unless `descs` (ranges a peer asked for) are this agent's registered memory
        of a kind it serves. Call it inside `serving()`, so the answer stays true while the ranges are used."""
        if descs.kind not in self.memory_kinds:
            raise AgentError(f"this {self.agent_kind} agent serves no {descs.kind.value} memory")
        self.check_registered(descs, what)

    @property
    def options(self) -> dict[str, Any]:
        """The transport options given at construction (passed to `listen` and `establish`)."""
        return dict(self._options)

    @contextmanager
    def serving(self):
        """Context of the serving thread while it touches registered memory; deregistration waits for it."""
        with self._serve_cv:
            self._serving_now += 1
        try:
            yield
        finally:
            with self._serve_cv:
                self._serving_now -= 1
                self._serve_cv.notify_all()

    # --- peers ---------------------------------------------------------------------------------------
    def _metadata(self) -> bytes:
        # The connection key travels with the endpoint: whoever was handed this metadata (the transceiver hands
        # it only to authenticated peers) may connect; anyone else who finds the port is refused.
        return seal(self.agent_kind, self.name, {"endpoint": self._listener.endpoint(),
                                                 "key": self.connection_key})

    def _connect(self, peer_metadata: bytes) -> str:
        name, payload = open_envelope(peer_metadata, self.agent_kind)
        endpoint = field(payload, "endpoint", dict)
        self.connection_class.check_endpoint(endpoint)
        key = field(payload, "key", bytes)
        if len(key) != wire.KEY_BYTES:
            raise PeerError(f"peer metadata: key of {len(key)} bytes, expected {wire.KEY_BYTES}")
        if name == self.name:
            raise PeerError(f"peer metadata carries this agent's own name {name!r}; names must be unique")
        with self._links_lock:
            old = self._links.pop(name, None)
            self._links[name] = _PeerLink(self, name, endpoint, key)
        if old is not None:
            old.stop(f"peer {name!r} re-connected with new metadata")
        return name

    def _disconnect(self, peer: str) -> None:
        with self._links_lock:
            link = self._links.pop(peer, None)
        if link is not None:
            link.stop(f"peer {peer!r} was disconnected")

    # --- transfers -----------------------------------------------------------------------------------
    def _post(self, op: str, peer: str, local: DescriptorList, remote: DescriptorList) -> TransferHandle:
        if not len(local):
            return ConnectionTransfer(0, 0)
        with self._links_lock:
            link = self._links.get(peer)
        if link is None:
            raise PeerError(f"{op} names peer {peer!r}, which was disconnected")
        h = ConnectionTransfer(len(local), local.nbytes, link)
        link.submit(_Request(op, local, remote, h))
        return h

    def _close(self) -> None:
        with self._links_lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.stop(f"agent {self.name!r} was closed")
        self._server.stop()
