"""Listening sockets of workers and the router: a process binds its own port, then says which it got.

Owns one rule: whoever serves HTTP binds the socket itself, so nothing can take the port between choosing it
and binding it (the free-port-then-bind race). With port 0 the kernel picks the port and the process writes
it to a port file (`--port-file PATH`: JSON `{"port": N, "pid": P}`, written atomically) for whoever started
it; `wait_port_file` reads it back, bounded. Never decides which address to bind (that is the config's).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time

from ..errors import ServingError

__all__ = ["bind", "announce", "wait_port_file"]


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 lets the kernel pick. IPv6 hosts are accepted.

    Made with proto IPPROTO_TCP and TCP_NODELAY (which accepted connections inherit): asyncio turns Nagle off
    only on sockets whose proto says TCP, and a socket made with proto 0 left it on, so every HTTP answer
    written in two parts (its headers, then its body) waited for the client's delayed ACK: ~40 ms a hop.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ServingError(f"cannot listen on {host}:{port}: {e}") from None
    sock.set_inheritable(False)
    return sock


def announce(path: str | None, port: int) -> None:
    """Write the bound port to `path` (tmp file + rename: a reader sees the whole file or none)."""
    if not path:
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"port": int(port), "pid": os.getpid()}, f)
    os.replace(tmp, path)


def wait_port_file(path: str, timeout: float, proc: subprocess.Popen | None = None) -> int:
    """The port a child announced in `path`, waiting up to `timeout` seconds.

    Raises:
        ServingError: the child exited first, the time ran out, or the file is not a port announcement.
    """
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc is not None and proc.poll() is not None:
            raise ServingError(f"the process exited with code {proc.returncode} before it announced its port")
        if time.monotonic() > deadline:
            raise ServingError(f"no port announced in {path} within {timeout:g}s")
        time.sleep(0.02)
    with open(path, encoding="utf-8") as f:
        try:
            port = json.load(f).get("port")
        except (ValueError, AttributeError):
            port = None
    if type(port) is not int or not 0 < port < 65536:
        raise ServingError(f"{path} does not hold a port announcement")
    return port
