"""Agents a newcomer writes (issue 27): one that uses the attribute names the base class used to own, and
two whose peer process cannot start (it raises, or it hangs), for `kvbridge check-agent` to report once.

All are the example CmaAgent (examples/custom_agent.py) with one change.
"""

from __future__ import annotations

import multiprocessing
import threading

from examples.custom_agent import CmaAgent
from kvbridge.agents import MemoryRegion, RegionTable


class OwnNamesAgent(CmaAgent):
    """Keeps its own state under `_lock`, `_peers`, `_regions`, `_closed`, `_next_key` and takes `_lock` (a
    plain, non-reentrant Lock) in its hooks: the base class must not share any of these names."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._lock = threading.Lock()
        self._peers: dict[str, int] = {}
        self._regions = RegionTable()
        self._closed = "not a bool"
        self._next_key = "not an int"

    def _register(self, region: MemoryRegion, key: int) -> None:
        with self._lock:
            self._regions.add(key, region)

    def _unregister(self, region: MemoryRegion, key: int) -> None:
        with self._lock:
            self._regions.remove(key)

    def _connect(self, peer_metadata: bytes) -> str:
        peer = super()._connect(peer_metadata)
        with self._lock:
            self._peers[peer] = len(self._peers)
        return peer

    def _close(self) -> None:
        with self._lock:
            self._closed = "closed"
        super()._close()


def _in_peer_process() -> bool:
    return multiprocessing.parent_process() is not None


class RaisesInPeerAgent(CmaAgent):
    """Its constructor raises in the peer process (a missing device, a bad option...)."""

    def __init__(self, name: str) -> None:
        if _in_peer_process():
            raise RuntimeError("peer-side constructor failed on purpose (subclass_agents.py)")
        super().__init__(name)


def hang_here_forever() -> None:
    threading.Event().wait()


class HangsInPeerAgent(CmaAgent):
    """Its registration never returns in the peer process (a deadlock)."""

    def _register(self, region: MemoryRegion, key: int) -> None:
        if _in_peer_process():
            hang_here_forever()
