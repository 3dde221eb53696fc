"""Child processes for the connector tests (spawned: they import nothing from the test process)."""

from __future__ import annotations

import os
import time

import numpy as np

BLOCK = 64 << 10  # bytes per object


def pattern(n_objects: int, writer: int) -> np.ndarray:
    """Position-dependent bytes for `n_objects` objects; writers differ in every object."""
    x = np.arange(n_objects * BLOCK // 4, dtype=np.uint32) * np.uint32(2654435761) + np.uint32(writer * 7919 + 1)
    return x.view(np.uint8)


def write_objects(root: str, names: list[str], writer: int, rounds: int, tag: bytes, gate: str | None = None) -> int:
    """Write every object `rounds` times (the same bytes each round) through a FileAgent; returns writes done.

    gate: a path; after the first round, wait (up to 60 s) until it exists before writing the others, so a
    reader can be sure to read while this writer is still writing."""
    from kvbridge.agents import DescriptorList, MemoryRegion
    from kvbridge.agents.file_agent import FileAgent, file_set, object_addrs

    src = pattern(len(names), writer)
    agent = FileAgent(f"writer{writer}", io_threads=2)
    reg = agent.register_memory(MemoryRegion.of(src))
    peer = agent.connect(file_set(root, names, tag))
    n = len(names)
    lengths = np.full(n, BLOCK, dtype=np.int64)
    local = DescriptorList(src.ctypes.data + np.arange(n, dtype=np.int64) * BLOCK, lengths)
    done = 0
    for r in range(rounds):
        h = agent.write(peer, local, DescriptorList(object_addrs(np.arange(n)), lengths))
        h.wait(60)
        h.release()
        done += n
        if r == 0 and gate is not None:
            deadline = time.monotonic() + 60
            while not os.path.exists(gate):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"writer {writer}: the reader did not open the gate {gate} within 60 s")
                time.sleep(0.01)
    reg.release()
    agent.close()
    return done


def evict_loop(root: str, namespace: str, max_bytes: int, rounds: int) -> int:
    """Run eviction `rounds` times against a shared root (another process does too); returns runs that held
    the lock."""
    from kvbridge.executor.connector.store import KvStore

    store = KvStore(root, namespace, 2, max_bytes=max_bytes)
    return sum(store.evict() is not None for _ in range(rounds))
