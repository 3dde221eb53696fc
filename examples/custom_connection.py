"""A complete custom Connection in one page: Unix domain sockets, made a TransferAgent by ConnectionAgent.

Write a Connection when your library can only send and receive (sockets, pipes, MPI, a vendor's
collective library): implement listen/establish, send/recv of whole buffers, poll and close, and
ConnectionAgent does the rest: requests, bounds checks on the serving side, handles, deadlines, cancel.
This one relies on the default send_regions/recv_regions, which gather scattered descriptors into a staging
buffer and send it in chunks. It passes kvbridge's agent conformance suite
(`kvbridge check-agent examples.custom_connection:UdsAgent`) like the built-in agents. Use it by name after
registering it:

    from kvbridge.agents import register_agent, create_agent
    from examples.custom_connection import UdsAgent
    register_agent("uds", UdsAgent)
    agent = create_agent("uds", "ctx-rank0")

Limits: processes of one host (a socket path), host memory only.
"""

from __future__ import annotations

import os
import select
import shutil
import socket
import tempfile
import time
from typing import Any

from kvbridge.agents import (Connection, ConnectionAgent, ConnectionClosed, ConnectionDeadline, ConnectionFailed,
                             Listener, PeerError)


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise ConnectionDeadline("deadline passed")
    return left


class UdsConnection(Connection):
    """One AF_UNIX stream socket; blocking calls with the time left until the deadline."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self._sock = sock

    @classmethod
    def listen(cls, options: dict[str, Any]) -> "UdsListener":
        return UdsListener()

    @classmethod
    def check_endpoint(cls, endpoint: Any) -> None:
        super().check_endpoint(endpoint)
        if not isinstance(endpoint.get("path"), str) or not endpoint["path"].startswith("/"):
            raise PeerError("peer endpoint: 'path' must be an absolute socket path")

    @classmethod
    def establish(cls, endpoint: dict[str, Any], deadline: float, options: dict[str, Any]) -> "UdsConnection":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(_left(deadline))
            sock.connect(endpoint["path"])
        except OSError as e:
            sock.close()
            raise ConnectionFailed(f"cannot connect to {endpoint['path']}: {e}") from None
        return cls(sock)

    def send(self, buffer, deadline: float) -> None:
        try:
            self._sock.settimeout(_left(deadline))
            self._sock.sendall(memoryview(buffer).cast("B"))
        except socket.timeout:
            raise ConnectionDeadline("send missed its deadline") from None
        except OSError as e:
            raise ConnectionClosed(f"send failed: {e}") from None

    def recv(self, buffer, deadline: float) -> None:
        view, got = memoryview(buffer).cast("B"), 0
        while got < len(view):
            try:
                self._sock.settimeout(_left(deadline))
                n = self._sock.recv_into(view[got:])
            except socket.timeout:
                raise ConnectionDeadline(f"recv missed its deadline after {got} bytes") from None
            except OSError as e:
                raise ConnectionClosed(f"recv failed: {e}") from None
            if n == 0:
                raise ConnectionClosed(f"peer closed the connection after {got} of {len(view)} bytes")
            got += n

    def poll(self, timeout: float) -> bool:
        return bool(select.select([self._sock], [], [], timeout)[0])

    def _interrupt(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self._sock.close()


class UdsListener(Listener):
    """A socket file in a private temporary directory, removed on close."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="kvb-uds-")
        self._path = os.path.join(self._dir, "agent.sock")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self._path)
        self._sock.listen(64)

    def endpoint(self) -> dict[str, Any]:
        return {"path": self._path}

    def accept(self, timeout: float) -> UdsConnection | None:
        if not select.select([self._sock], [], [], timeout)[0]:
            return None
        try:
            sock, _ = self._sock.accept()
        except OSError:
            return None
        return UdsConnection(sock)

    def close(self) -> None:
        self._sock.close()
        shutil.rmtree(self._dir, ignore_errors=True)


class UdsAgent(ConnectionAgent):
    """Host-memory transfers between processes of one host over Unix domain sockets."""

    agent_kind = "uds"
    connection_class = UdsConnection
