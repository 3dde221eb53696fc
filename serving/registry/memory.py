"""The in-memory store the router holds when `cluster_uri` is `http://<router>` (no extra service to run).

Owns keys, leases (expiry checked on every call and by `sweep`, which the router runs every SWEEP_S) and a
bounded history of changes for watchers: a watcher that fell further behind than the history gets a fresh
Snapshot. Lives on the router's event loop only (no locks). Never authenticates: the router's HTTP routes
(http_store.py) check the caller's proof before they call it, and the values are signed records anyway.
Its content is lost when the router restarts; workers re-register on their next heartbeat (refresh -> False).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from .store import Change, Conflict, Entry, Snapshot, Store

__all__ = ["MemoryStore", "SWEEP_S", "HISTORY"]

SWEEP_S = 0.2
HISTORY = 4096  # changes kept for watchers that ask from a revision


@dataclass
class _Lease:
    ttl_s: float
    expires: float
    keys: set[str] = field(default_factory=set)


class MemoryStore(Store):
    def __init__(self, uri: str = "memory:") -> None:
        self.uri = uri
        self.revision = 0
        self._entries: dict[str, Entry] = {}
        self._leases: dict[str, _Lease] = {}
        self._history: collections.deque[Change] = collections.deque(maxlen=HISTORY)
        self._changed = asyncio.Event()
        self._ids = itertools.count(1)

    # --- the Store interface ------------------------------------------------------------------------------
    async def set(self, key: str, value: str, ttl_s: float, prev_revision: int | None = None) -> tuple[str, int]:
        self.sweep()
        cur = self._entries.get(key)
        if prev_revision is not None and (cur.revision if cur else 0) != prev_revision:
            raise Conflict(key, cur)
        if cur is not None and cur.lease:
            self._unbind(key, cur.lease)
        lease = f"{next(self._ids):x}{secrets.token_hex(4)}"
        self._leases[lease] = _Lease(ttl_s, time.monotonic() + ttl_s, {key})
        self._put(Entry(key, value, self.revision + 1, lease))
        return lease, self.revision

    async def refresh(self, lease: str) -> bool:
        self.sweep()
        got = self._leases.get(lease)
        if got is None:
            return False
        got.expires = time.monotonic() + got.ttl_s
        return True

    async def revoke(self, lease: str) -> None:
        got = self._leases.pop(lease, None)
        for key in sorted(got.keys if got else ()):
            self._remove(key)

    async def get(self, key: str) -> Entry | None:
        self.sweep()
        return self._entries.get(key)

    async def delete(self, key: str) -> None:
        cur = self._entries.get(key)
        if cur is not None:
            self._unbind(key, cur.lease)
            self._remove(key)

    async def list(self, prefix: str) -> dict[str, Entry]:
        self.sweep()
        return {k: e for k, e in self._entries.items() if k.startswith(prefix)}

    async def watch(self, prefix: str) -> AsyncIterator[Snapshot | Change]:
        snap = Snapshot(self.revision, await self.list(prefix))
        yield snap
        rev = snap.revision
        while True:
            got = self.changes(prefix, rev)
            if got is None:  # fell behind the history: start over from a snapshot
                snap = Snapshot(self.revision, await self.list(prefix))
                yield snap
                rev = snap.revision
                continue
            for c in got:
                rev = c.revision
                yield c
            if not got:
                await self.wait(rev, 1.0)

    # --- for the router's HTTP routes and its sweep task ------------------------------------------------------
    def changes(self, prefix: str, after: int) -> list[Change] | None:
        """Changes under prefix after revision `after`; None when the history no longer reaches back there."""
        if after > self.revision:  # a revision this store never had (it restarted): start over
            return None
        if self._history and self._history[0].revision > after + 1 and after < self.revision:
            return None
        if not self._history and after < self.revision:
            return None
        return [c for c in self._history if c.revision > after and c.key.startswith(prefix)]

    async def wait(self, after: int, timeout: float) -> None:
        """Until the revision passes `after` or `timeout` seconds passed."""
        if self.revision > after:
            return
        ev = self._changed
        try:
            await asyncio.wait_for(ev.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def sweep(self) -> None:
        """Drop every lease whose TTL ran out, and its keys."""
        now = time.monotonic()
        for lease in [k for k, v in self._leases.items() if v.expires <= now]:
            for key in sorted(self._leases.pop(lease).keys):
                self._remove(key)

    async def run_sweeper(self) -> None:
        while True:
            self.sweep()
            await asyncio.sleep(SWEEP_S)

    # --- internals ----------------------------------------------------------------------------------------------
    def _unbind(self, key: str, lease: str) -> None:
        got = self._leases.get(lease)
        if got is not None:
            got.keys.discard(key)
            if not got.keys:
                del self._leases[lease]

    def _put(self, e: Entry) -> None:
        self.revision = e.revision
        self._entries[e.key] = e
        self._record(Change("put", e.key, e.value, e.revision))

    def _remove(self, key: str) -> None:
        if self._entries.pop(key, None) is None:
            return
        self.revision += 1
        self._record(Change("delete", key, "", self.revision))

    def _record(self, c: Change) -> None:
        self._history.append(c)
        ev, self._changed = self._changed, asyncio.Event()
        ev.set()
