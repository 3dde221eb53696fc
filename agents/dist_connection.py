"""torch.distributed point-to-point as a Connection: agents "gloo" (host memory) and "nccl" (GPU memory).

Owns the two-member process group that each (requester, server) connection gets of its own, the way vLLM's
P2pNcclConnector moves KV: control messages (request headers, descriptors, responses) travel over a TCP
socket (TcpConnection, inherited), the bulk bytes over `ProcessGroupGloo` / `ProcessGroupNCCL` send/recv.

How two processes that share no torch.distributed world form a group: a requester dials the agent's port
and sends a HELLO carrying a random pair id (then answers the challenge every connection gets, conn_wire.py).
On the first bulk transfer both sides build the backend with rank 0 (server) and 1 (requester), size 2, over
the pair's rendezvous store: the server's is an in-process HashStore of that pair alone, and the requester
reaches it over a second connection to the same port, whose HELLO names the pair and which proves itself like
the first (dist_store.py). No store port is open: torch's TCPStore would serve and list its keys to anyone.
`dist.new_group` is not used: it needs a common default world.

The same code moves host memory through gloo (tested on CPU in CI) and device memory through NCCL:
descriptors are gathered into / scattered from a staging tensor (staging.py), one process-group message
per chunk. Waits are bounded: gloo's `work.wait(remaining)` (a peer that dies fails it at once), NCCL's
`work.is_completed()` polled to the deadline, then `abort()` of the communicator. A timed-out or aborted
group is never reused: the connection is closed and the next transfer forms a new one.

Why two registry names and not an option: peers must agree on the backend, and the agent kind in the
metadata envelope makes a gloo/nccl mismatch a clear PeerError at connect() instead of a hang.

Options: host, advertise_host, vectored (as for tcp); pg_timeout: seconds for the backend's own
watchdog (default 600; kvbridge's deadlines end waits long before).
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from datetime import timedelta
from typing import Any, ClassVar

import numpy as np

from ..errors import (AgentError, ConnectionClosed, ConnectionDeadline, ConnectionFailed, PeerError,
                      ProtocolError)
from .base import DescriptorList, MemoryKind
from . import conn_wire as wire
from .conn_agent import ConnectionAgent
from .dist_store import new_store, remote_store, serve_store
from .staging import chunks, gather, scatter
from .tcp import TCP_OPTIONS, WILDCARD_HOSTS, TcpConnection, TcpListener, default_host, dial

__all__ = ["GlooAgent", "NcclAgent", "TorchDistConnection", "GlooConnection", "NcclConnection"]

log = logging.getLogger(__name__)

_OPTIONS = TCP_OPTIONS | {"pg_timeout"}
_HELLO = struct.Struct("<4sHB8s32s")  # magic, version, role, backend name (NUL-padded), pair id (hex)
_MAGIC, _VERSION = b"KVBD", 2
CONTROL, STORE = 0, 1  # a HELLO's role: a pair's requests, or its rendezvous store
HANDSHAKE_TIMEOUT = 5.0


def _hello(backend: str, pair_id: str, role: int) -> np.ndarray:
    raw = _HELLO.pack(_MAGIC, _VERSION, role, backend.encode(), pair_id.encode())
    return np.frombuffer(bytearray(raw), np.uint8)


class _Pair:
    def __init__(self) -> None:
        self.store = new_store(30.0)
        self.refs, self.store_taken = 1, False


class _Pairs:
    """The serving agent's pairs: each one's rendezvous store, alive while its connections are."""

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._pairs: dict[str, _Pair] = {}

    def open(self, pair_id: str) -> _Pair:
        with self._mu:
            if pair_id in self._pairs:
                raise ProtocolError("hello: that pair id is in use")
            pair = self._pairs[pair_id] = _Pair()
            return pair

    def attach_store(self, pair_id: str) -> _Pair:
        with self._mu:
            pair = self._pairs.get(pair_id)
            if pair is None or pair.store_taken:
                raise ProtocolError("store hello: no pair of that id waits for its store")
            pair.refs, pair.store_taken = pair.refs + 1, True
            return pair

    def release(self, pair_id: str) -> None:
        with self._mu:
            pair = self._pairs.get(pair_id)
            if pair is not None:
                pair.refs -= 1
                if pair.refs <= 0:
                    del self._pairs[pair_id]


class TorchDistConnection(TcpConnection):
    """Control over the inherited TCP socket; send_regions/recv_regions over a 2-member process group."""

    backend: ClassVar[str] = "gloo"
    staging_bytes: ClassVar[int] = 32 << 20

    def __init__(self, sock: socket.socket, *, vectored: bool = True, rank: int = 0, pair_id: str = "",
                 peer: tuple[str, int] = ("", 0), local_host: str = "127.0.0.1", pg_timeout: float = 600.0,
                 pairs: _Pairs | None = None) -> None:
        super().__init__(sock, vectored=vectored)
        self.rank, self.pair_id = rank, pair_id
        self._peer, self._local_host, self._pg_timeout = peer, local_host, pg_timeout
        self._pairs, self._role, self._pair = pairs, CONTROL, None  # the server's side of a pair
        self._key: bytes | None = None       # the requester's: proves its store connection
        self._store_conn: TcpConnection | None = None
        self._remote = None                  # the requester's store over it (see _group)
        self._pg = None

    def greet(self, deadline: float) -> None:
        """Server side: read the requester's HELLO (backend, role, the pair id); a pair's requests open it."""
        raw = np.empty(_HELLO.size, dtype=np.uint8)
        self.recv(raw, min(deadline, time.monotonic() + HANDSHAKE_TIMEOUT))
        magic, version, role, backend, pair_id = _HELLO.unpack(raw.tobytes())
        if magic != _MAGIC or version != _VERSION:
            raise ProtocolError(f"hello: magic {magic!r} version {version} (not a kvbridge {self.backend} "
                                f"peer of HELLO version {_VERSION})")
        theirs = backend.rstrip(b"\0").decode("ascii", "replace")
        if theirs != self.backend:
            raise ProtocolError(f"hello: backend {theirs!r}, this side uses {self.backend}")
        pid = pair_id.decode("ascii", "replace")
        if len(pid) != 32 or any(c not in "0123456789abcdef" for c in pid):
            raise ProtocolError("hello: pair id is not 32 hex digits")
        if role not in (CONTROL, STORE) or self._pairs is None:
            raise ProtocolError(f"hello: role {role} (0: requests, 1: rendezvous store)")
        self.pair_id, self._role = pid, role
        if role == CONTROL:
            self._pair = self._pairs.open(pid)

    def service(self):
        """A store connection (its peer proved itself) serves the pair's rendezvous store to the end."""
        if self._role != STORE:
            return None
        self._pair = self._pairs.attach_store(self.pair_id)
        store = self._pair.store
        return lambda stopping: serve_store(self, store, stopping, HANDSHAKE_TIMEOUT)

    def answered(self, key: bytes) -> None:
        self._key = bytes(key)

    # --- set-up --------------------------------------------------------------------------------------
    @classmethod
    def listen(cls, options: dict[str, Any]) -> "DistListener":
        unknown = set(options) - _OPTIONS
        if unknown:
            raise AgentError(f"unknown {cls.backend} agent options {sorted(unknown)}; "
                             f"known: {sorted(_OPTIONS)}")
        return DistListener(cls, options)

    @classmethod
    def check_endpoint(cls, endpoint: Any) -> None:
        super().check_endpoint(endpoint)
        backend = endpoint.get("backend")
        if backend != cls.backend:
            raise PeerError(f"peer endpoint: backend {backend!r}, this side uses {cls.backend!r}")

    @classmethod
    def establish(cls, endpoint: dict[str, Any], deadline: float,
                  options: dict[str, Any]) -> "TorchDistConnection":
        sock = dial(endpoint["host"], endpoint["port"], deadline)
        pair_id = os.urandom(16).hex()
        conn = cls(sock, vectored=options.get("vectored", True), rank=1, pair_id=pair_id,
                   peer=(endpoint["host"], endpoint["port"]), local_host=_local_host(options),
                   pg_timeout=float(options.get("pg_timeout", 600.0)))
        try:
            conn.send(_hello(cls.backend, pair_id, CONTROL), deadline)
        except BaseException:
            conn.close()
            raise
        return conn

    # --- the process group ---------------------------------------------------------------------------
    def _group(self, deadline: float):
        if self._pg is not None:
            return self._pg
        left = deadline - time.monotonic()
        if left <= 0:
            raise ConnectionDeadline("no time left to form the process group")
        if self._pair is not None:  # the server: the pair's store is here
            store = self._pair.store
            store.set_timeout(timedelta(seconds=left))
        else:  # held here: the C++ group reaches a Python store only while its Python object lives
            store = self._remote = remote_store(self._open_store(deadline), left)
        try:
            self._pg = self._make_group(store, timedelta(seconds=self._pg_timeout))
        except (RuntimeError, ValueError) as e:
            raise _dist_error(f"forming the {self.backend} group with the peer", e) from None
        return self._pg

    def _open_store(self, deadline: float) -> TcpConnection:
        """The requester's connection to the pair's rendezvous store: its HELLO, then the same proof."""
        if self._key is None:
            raise ConnectionFailed("no connection key to prove the store connection with (the agent hands it "
                                   "over after the first connection's proof)")
        conn = TcpConnection(dial(self._peer[0], self._peer[1], deadline), vectored=False)
        try:
            conn.send(_hello(self.backend, self.pair_id, STORE), deadline)
            wire.prove(conn, self._key, deadline)
        except BaseException:
            conn.close()
            raise
        self._store_conn = conn
        return conn

    def _make_group(self, store, timeout: timedelta):
        from torch.distributed import ProcessGroupGloo

        # `_Options`, `_timeout` and `_devices` are torch's own API for these options (its distributed_c10d
        # sets them the same way; there is no public spelling), not another kvbridge class's privates.
        opts = ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [ProcessGroupGloo.create_device(hostname=self._local_host)]
        return ProcessGroupGloo(store, self.rank, 2, opts)

    def _finish(self, work, deadline: float, what: str) -> None:
        """Wait for one send/recv, bounded by the deadline (gloo: the wait itself is bounded)."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise ConnectionDeadline(f"{what}: deadline passed before the process-group wait")
        try:
            work.wait(timedelta(seconds=left))
        except RuntimeError as e:
            raise _dist_error(what, e) from None

    # --- bulk data -----------------------------------------------------------------------------------
    # Double-buffered: the staging tensor is two halves; chunk i uses half i % 2 and tag i % 2, so that
    # gathering (or scattering) one chunk overlaps the transmission of the next one.
    def _halves(self, descs: DescriptorList):
        stage = self._stage(descs.kind, descs.device)
        half = self.staging_bytes // 2
        return stage[:half], stage[half:2 * half], half

    def send_regions(self, descs: DescriptorList, deadline: float) -> None:
        pg = self._group(deadline)
        with self._on_device(descs):
            bufs = self._halves(descs)
            pending = None
            for i, (addrs, lengths, n) in enumerate(chunks(descs.addrs, descs.lengths, bufs[2])):
                buf = bufs[i % 2][:n]  # its previous send (chunk i - 2) was waited for below
                with self._copy_lock:  # caller memory is only touched here, and finished before release
                    if self._aborted:
                        raise ConnectionFailed("connection aborted")
                    gather(descs.kind, descs.device, addrs, lengths, buf)
                    self._settle_device(deadline)
                work = pg.send([buf], 1 - self.rank, i % 2)
                if pending is not None:
                    self._finish(pending, deadline, f"sending chunk {i - 1}")
                pending = work
            if pending is not None:
                self._finish(pending, deadline, "sending the last chunk")

    def recv_regions(self, descs: DescriptorList, deadline: float) -> None:
        pg = self._group(deadline)
        with self._on_device(descs):
            bufs = self._halves(descs)
            pieces = list(chunks(descs.addrs, descs.lengths, bufs[2]))
            posted = pg.recv([bufs[0][:pieces[0][2]]], 1 - self.rank, 0) if pieces else None
            for i, (addrs, lengths, n) in enumerate(pieces):
                work = posted
                if i + 1 < len(pieces):  # the other half was scattered out in the previous iteration
                    posted = pg.recv([bufs[(i + 1) % 2][:pieces[i + 1][2]]], 1 - self.rank, (i + 1) % 2)
                self._finish(work, deadline, f"receiving chunk {i} ({n} bytes)")
                with self._copy_lock:
                    if self._aborted:
                        raise ConnectionFailed("connection aborted")
                    scatter(descs.kind, descs.device, addrs, lengths, bufs[i % 2][:n])
                    self._settle_device(deadline)

    def _on_device(self, descs: DescriptorList):
        from contextlib import nullcontext

        if descs.kind is MemoryKind.VRAM:
            import torch

            return torch.cuda.device(descs.device)
        return nullcontext()

    def _settle_device(self, deadline: float) -> None:
        """Host copies are synchronous; NcclConnection waits (bounded) for the device copies here."""

    # --- teardown ------------------------------------------------------------------------------------
    def close(self) -> None:
        super().close()
        self._pg = None
        store_conn, self._store_conn = self._store_conn, None  # the store object stays: a group being
        # shut down may still call it (it then fails by name, the connection being closed)
        if store_conn is not None:
            store_conn.close()
        if self._pair is not None:
            self._pair = None
            self._pairs.release(self.pair_id)


class GlooConnection(TorchDistConnection):
    """Host memory through gloo send/recv."""

    backend = "gloo"
    memory_kinds = frozenset({MemoryKind.DRAM})


class NcclConnection(TorchDistConnection):
    """CUDA memory through NCCL send/recv; control stays on the TCP socket (NCCL moves no host bytes)."""

    backend = "nccl"
    memory_kinds = frozenset({MemoryKind.VRAM})

    def _make_group(self, store, timeout: timedelta):
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False
        opts._timeout = timeout  # torch's own spelling (as in its distributed_c10d), not a private read
        opts.group_name = f"kvbridge-{self.pair_id}"
        return ProcessGroupNCCL(store, self.rank, 2, opts)

    def _finish(self, work, deadline: float, what: str) -> None:
        # NCCL's wait() only orders streams; completion is polled so the deadline holds on the host, and an
        # abort() from another thread is seen within a millisecond (the communicator is then aborted).
        pause = 20e-6
        while not work.is_completed():
            if self._aborted or time.monotonic() >= deadline:
                self._abort_group()
                if self._aborted:
                    raise ConnectionFailed(f"{what}: connection aborted")
                raise ConnectionDeadline(f"{what}: NCCL operation not complete by the deadline")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        try:
            work.wait()  # completed: surfaces an error, makes the current stream follow NCCL's
        except RuntimeError as e:
            self._abort_group()
            raise _dist_error(what, e) from None

    def _settle_device(self, deadline: float) -> None:
        import torch

        done = torch.cuda.Event()
        done.record()
        while not done.query():
            if time.monotonic() >= deadline:
                raise ConnectionDeadline("device copies to/from the staging buffer did not finish in time")
            time.sleep(50e-6)

    def _abort_group(self) -> None:
        pg, self._pg = self._pg, None
        if pg is not None:
            try:
                pg.abort()
            except Exception as e:  # noqa: BLE001
                log.warning("aborting an NCCL group failed: %s", e)

    def close(self) -> None:
        pg = self._pg
        super().close()
        if pg is not None:
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001
                pass


class DistListener(TcpListener):
    """The agent's one port: pairs' request connections and their rendezvous-store connections."""

    def __init__(self, conn_class: type[TorchDistConnection], options: dict[str, Any]) -> None:
        host = options.get("host") or default_host()
        super().__init__(host, options.get("advertise_host"), options.get("vectored", True), conn_class)
        self._endpoint.update(backend=conn_class.backend)
        self._options = options
        self._local_host = _local_host(options)
        self._pairs = _Pairs()

    def _wrap(self, sock: socket.socket) -> TorchDistConnection:
        return self._conn_class(sock, vectored=self._vectored, rank=0, local_host=self._local_host,
                                pg_timeout=float(self._options.get("pg_timeout", 600.0)), pairs=self._pairs)


def _local_host(options: dict[str, Any]) -> str:
    """The address this process's side of a group listens on (must be reachable by the peer)."""
    host = options.get("advertise_host") or options.get("host") or default_host()
    return socket.gethostbyname(socket.gethostname()) if host in WILDCARD_HOSTS else host


def _dist_error(what: str, e: Exception) -> ConnectionFailed:
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    low = text.lower()
    if "closed by peer" in low or "connection reset" in low or "broken pipe" in low:
        return ConnectionClosed(f"{what}: peer went away ({text})")
    if "timed out" in low or "timeout" in low:
        return ConnectionDeadline(f"{what}: {text}")
    return ConnectionFailed(f"{what}: {text}")


class GlooAgent(ConnectionAgent):
    """Host-memory transfers through torch.distributed gloo send/recv (registry name "gloo")."""

    agent_kind = "gloo"
    connection_class = GlooConnection


class NcclAgent(ConnectionAgent):
    """GPU-memory transfers through NCCL send/recv, one 2-rank communicator per peer pair ("nccl").

    Needs a CUDA build of torch with NCCL. Recommended: TORCH_NCCL_ASYNC_ERROR_HANDLING=2 in the serving
    process, so that NCCL's watchdog cleans up a failed communicator instead of ending the process.
    """

    agent_kind = "nccl"
    connection_class = NcclConnection

    def __init__(self, name: str, **kwargs: Any) -> None:
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available()):
            raise AgentError("the nccl agent needs torch with CUDA and NCCL (this torch: "
                             f"{torch.__version__}, cuda available: {torch.cuda.is_available()}); "
                             "use the gloo or tcp agent for host memory")
        super().__init__(name, **kwargs)
