"""TcpAgent: the TransferAgent that needs nothing but Python and a TCP/IP stack (registry name "tcp").

Owns TcpConnection and TcpListener, the Connection (connection.py) over one TCP socket per direction and
peer pair; ConnectionAgent makes them an agent and serves peers' requests from background threads. Host
memory only. The data path moves registered memory in place: the descriptors become an iovec array (numpy,
no Python object per fragment) and readv/writev move up to IOV_MAX ranges per system call, straight
between the socket and the registered bytes; partial progress is advanced with vectorised arithmetic.
Where libc's readv/writev cannot be loaded (Windows) it falls back to send/recv_into per coalesced range.

Every wait is a poll() bounded by the caller's deadline; abort() shuts the socket down, which wakes a
blocked poll at once, and waits out any system call in progress, so that afterwards no caller memory is
touched. Never blocks in the kernel: the socket is non-blocking.

Options (keywords of TcpAgent / create_agent("tcp", name, ...)):
    host: address to listen on (default $KVBRIDGE_AGENT_HOST or 127.0.0.1; "0.0.0.0" for all interfaces)
    advertise_host: address peers dial (default: host, or this machine's name for a wildcard host)
    vectored: use readv/writev (default True where available)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import select
import socket
import threading
import time
from typing import Any

import numpy as np

from ..errors import AgentError, ConnectionClosed, ConnectionDeadline, ConnectionFailed, PeerError
from .base import DescriptorList, MemoryKind
from .conn_agent import ConnectionAgent
from .connection import Connection, Listener
from .staging import coalesce

__all__ = ["TcpAgent", "TcpConnection", "TcpListener", "default_host", "dial", "TCP_OPTIONS", "WILDCARD_HOSTS"]

TCP_OPTIONS = {"host", "advertise_host", "vectored"}
WILDCARD_HOSTS = {"", "0.0.0.0", "::"}


def _load_vectored():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        fns = (libc.readv, libc.writev)
    except (OSError, AttributeError, TypeError):
        return None
    for fn in fns:
        fn.restype = ctypes.c_ssize_t
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    return fns


_VECTORED = _load_vectored()
try:
    IOV_MAX = min(int(os.sysconf("SC_IOV_MAX")), 1024)
except (AttributeError, ValueError, OSError):
    IOV_MAX = 1024
IOV_MAX = IOV_MAX if IOV_MAX > 0 else 1024


def default_host() -> str:
    return os.environ.get("KVBRIDGE_AGENT_HOST", "127.0.0.1")


def wait_fd(fd: int, write: bool, timeout: float) -> bool:
    """True when fd is writable (write) or readable/hung up (read) within timeout seconds."""
    timeout = max(0.0, timeout)
    if hasattr(select, "poll"):
        p = select.poll()
        p.register(fd, (select.POLLOUT if write else select.POLLIN) | select.POLLERR | select.POLLHUP)
        return bool(p.poll(int(timeout * 1000 + 0.999)))
    r, w, _ = select.select([] if write else [fd], [fd] if write else [], [], timeout)
    return bool(r or w)


def _addr_len(buffer) -> tuple[int, int]:
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise ConnectionFailed("send/recv buffers must be contiguous")
        return int(buffer.ctypes.data), int(buffer.nbytes)
    raise ConnectionFailed(f"a TCP connection moves host numpy buffers, not {type(buffer).__name__}")


class TcpConnection(Connection):
    """One non-blocking TCP socket; messages are byte ranges of the stream (sizes known to both sides)."""

    memory_kinds = frozenset({MemoryKind.DRAM})

    def __init__(self, sock: socket.socket, *, vectored: bool = True) -> None:
        super().__init__()
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        self._sock = sock
        self._fd = sock.fileno()
        self._io_lock = threading.Lock()  # held across each system call that touches caller memory
        self._vectored = bool(vectored) and _VECTORED is not None

    # --- set-up --------------------------------------------------------------------------------------
    @classmethod
    def listen(cls, options: dict[str, Any]) -> "TcpListener":
        unknown = set(options) - TCP_OPTIONS
        if unknown:
            raise AgentError(f"unknown tcp agent options {sorted(unknown)}; known: {sorted(TCP_OPTIONS)}")
        return TcpListener(options.get("host") or default_host(), options.get("advertise_host"),
                           options.get("vectored", True), cls)

    @classmethod
    def check_endpoint(cls, endpoint: Any) -> None:
        super().check_endpoint(endpoint)
        host, port = endpoint.get("host"), endpoint.get("port")
        if not isinstance(host, str) or not 0 < len(host) <= 255:
            raise PeerError(f"peer endpoint: host {host!r} is not a host name or address")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise PeerError(f"peer endpoint: port {port!r} is not a TCP port")

    @classmethod
    def establish(cls, endpoint: dict[str, Any], deadline: float, options: dict[str, Any]) -> "TcpConnection":
        sock = dial(endpoint["host"], endpoint["port"], deadline)
        return cls(sock, vectored=options.get("vectored", True))

    # --- I/O -----------------------------------------------------------------------------------------
    def send(self, buffer, deadline: float) -> None:
        addr, n = _addr_len(buffer)
        self._io(True, np.array([addr], np.int64), np.array([n], np.int64), deadline)

    def recv(self, buffer, deadline: float) -> None:
        addr, n = _addr_len(buffer)
        self._io(False, np.array([addr], np.int64), np.array([n], np.int64), deadline)

    def send_regions(self, descs: DescriptorList, deadline: float) -> None:
        self._io(True, *coalesce(descs.addrs, descs.lengths), deadline)

    def recv_regions(self, descs: DescriptorList, deadline: float) -> None:
        self._io(False, *coalesce(descs.addrs, descs.lengths), deadline)

    def poll(self, timeout: float) -> bool:
        if self._aborted:
            raise ConnectionFailed("connection aborted")
        return wait_fd(self._fd, False, timeout)

    def _io(self, write: bool, addrs: np.ndarray, lengths: np.ndarray, deadline: float) -> None:
        """Move every range, in order, between the socket and memory; raise on EOF, error or deadline."""
        iov = np.empty((addrs.shape[0], 2), dtype=np.uint64)
        iov[:, 0] = addrs
        iov[:, 1] = lengths
        total, moved, i = int(lengths.sum()), 0, 0
        while i < iov.shape[0]:
            part = iov[i:i + IOV_MAX]
            with self._io_lock:
                if self._aborted:
                    raise ConnectionFailed("connection aborted")
                n = self._syscall(write, part)
            if n is None or (n == 0 and write):  # would block: wait for the socket, bounded by the deadline
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ConnectionDeadline(f"{'send' if write else 'recv'} of {total} bytes missed its "
                                             f"deadline after {moved} bytes")
                wait_fd(self._fd, write, min(left, 1.0))
                continue
            if n == 0 and not write:
                raise ConnectionClosed(f"peer closed the connection after {moved} of {total} bytes")
            moved += n
            ends = np.cumsum(part[:, 1])
            done = int(np.searchsorted(ends, n, side="right"))
            if done < part.shape[0]:  # partial range: advance it in place
                skip = n - (int(ends[done - 1]) if done else 0)
                part[done, 0] += np.uint64(skip)
                part[done, 1] -= np.uint64(skip)
            i += done

    def _syscall(self, write: bool, part: np.ndarray) -> int | None:
        """One readv/writev (or send/recv_into); bytes moved, or None if the socket would block."""
        try:
            if self._vectored:
                r = _VECTORED[1 if write else 0](self._fd, part.ctypes.data, part.shape[0])
                if r >= 0:
                    return r
                err = ctypes.get_errno()
                if err in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):
                    return None
                raise OSError(err, os.strerror(err))
            mv = memoryview((ctypes.c_char * int(part[0, 1])).from_address(int(part[0, 0]))).cast("B")
            return self._sock.send(mv) if write else self._sock.recv_into(mv)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as e:
            if e.errno in (errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN, errno.ESHUTDOWN):
                raise ConnectionClosed(f"connection lost: {e.strerror or e}") from None
            raise ConnectionFailed(f"socket error: {e}") from None

    # --- teardown ------------------------------------------------------------------------------------
    def _interrupt(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        with self._io_lock:  # a system call in progress finishes before abort() returns
            pass

    def close(self) -> None:
        self._aborted = True
        with self._io_lock:
            self._sock.close()


def dial(host: str, port: int, deadline: float) -> socket.socket:
    left = deadline - time.monotonic()
    if left <= 0:
        raise ConnectionDeadline(f"no time left to connect to {host}:{port}")
    try:
        return socket.create_connection((host, port), timeout=left)
    except socket.timeout:
        raise ConnectionDeadline(f"connecting to {host}:{port} took longer than {left:.3g} s") from None
    except OSError as e:
        raise ConnectionFailed(f"cannot connect to {host}:{port}: {e.strerror or e}") from None


class TcpListener(Listener):
    """A listening TCP socket; accept() wraps each peer in `conn_class` (TcpConnection or a subclass)."""

    def __init__(self, host: str, advertise_host: str | None, vectored: bool,
                 conn_class: type[TcpConnection] = TcpConnection) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._sock = socket.create_server((host, 0), family=family, backlog=128)
        except OSError as e:
            raise AgentError(f"cannot listen on {host!r}: {e.strerror or e} (set host= or "
                             "$KVBRIDGE_AGENT_HOST to an address of this machine)") from None
        self._sock.setblocking(False)
        if not advertise_host:
            advertise_host = socket.gethostbyname(socket.gethostname()) if host in WILDCARD_HOSTS else host
        self._endpoint = {"host": advertise_host, "port": int(self._sock.getsockname()[1])}
        self._vectored = vectored
        self._conn_class = conn_class
        self._closed = False

    def endpoint(self) -> dict[str, Any]:
        return dict(self._endpoint)

    def accept(self, timeout: float) -> TcpConnection | None:
        if self._closed or not wait_fd(self._sock.fileno(), False, timeout):
            return None
        try:
            sock, _ = self._sock.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return None
        except OSError as e:
            if self._closed:
                return None
            raise ConnectionFailed(f"accept failed on {self._endpoint}: {e}") from None
        return self._wrap(sock)

    def _wrap(self, sock: socket.socket) -> TcpConnection | None:
        """The Connection for an accepted socket (None drops it); never reads from it (see Listener.accept)."""
        return self._conn_class(sock, vectored=self._vectored)

    def close(self) -> None:
        self._closed = True
        self._sock.close()


class TcpAgent(ConnectionAgent):
    """Host-memory transfers over TCP sockets: the fallback that runs wherever Python does.

    Args:
        name: unique among the peers this agent talks to.
        transfer_timeout, connect_timeout: see ConnectionAgent.
        host, advertise_host, vectored: see the module docstring.
    """

    agent_kind = "tcp"
    connection_class = TcpConnection
