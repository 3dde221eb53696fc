"""Process signals for fault injection in tests: wait until a SIGSTOPped process has really stopped."""

from __future__ import annotations

import os
import time


def wait_stopped(pid: int, timeout: float = 10.0) -> None:
    """Until every thread of `pid` is stopped (kill() returns before a running process has stopped)."""
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:
                continue  # a thread that ended meanwhile
        if states and all(st in ("T", "t") for st in states):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} not stopped within {timeout} s: {states}")
        time.sleep(0.005)
