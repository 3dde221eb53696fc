"""Fault injection for serving tests: find a worker's rank processes and stop them (SIGSTOP) for a while;
sockets that play a dead or a silent worker. Only the fault is injected; what stops or stays quiet is real."""

from __future__ import annotations

import contextlib
import os
import signal
import socket

from ..signals import wait_stopped


def rank_processes(pid: int) -> list[int]:
    """The rank processes a worker spawned: its children (from /proc) running multiprocessing's spawn_main."""
    out = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                spawned = b"spawn_main" in f.read()
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if ppid == pid and spawned:
            out.append(int(d))
    return out


@contextlib.contextmanager
def stopped(pids: list[int]):
    """SIGSTOP every process of `pids` (and wait until they are) for the block; SIGCONT them after, whatever
    happens."""
    try:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        for pid in pids:
            wait_stopped(pid)
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):  # killed meanwhile (a supervisor's kill of a stalled one)
                os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def dead_and_silent_ports():
    """Two local ports: one refuses connections (bound, not listening), one accepts them (kernel backlog)
    and never answers; yields their 'host:port' strings. Bound here, held until the block ends: no race."""
    dead, silent = socket.socket(), socket.socket()
    try:
        dead.bind(("127.0.0.1", 0))
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        yield tuple(f"127.0.0.1:{s.getsockname()[1]}" for s in (dead, silent))
    finally:
        dead.close()
        silent.close()
