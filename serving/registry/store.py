"""The one storage interface that cluster membership runs on, and the shapes it hands out.

A store holds string values under string keys, some of them bound to a lease with a TTL (the key disappears
when its lease is neither refreshed nor revoked within the TTL). Backends (registry/__init__.py opens one by
URI): `http://` (memory.py: the router holds it; http_store.py: the workers' client to it) and `etcd://`
(etcd_store.py, a real etcd server). Every method is a coroutine bounded by the backend's call timeout and
raises StoreUnavailable when the store cannot be reached in time: the caller decides what an outage means
(the router keeps its last membership; a worker keeps serving and retries). Never interprets a value.

    set(key, value, ttl_s, prev_revision=None) -> (lease, revision)
        prev_revision None: unconditional; 0: only if the key does not exist; N: only if the key's last
        modification is revision N. Otherwise Conflict(current entry or None).
    refresh(lease) -> bool      False: the lease is gone (expired or revoked): set the key again
    revoke(lease)               deletes every key bound to it
    get(key) -> Entry | None;  delete(key);  list(prefix) -> {key: Entry}
    watch(prefix)               an async iterator: first a Snapshot (every key under prefix and the
                                revision it was taken at), then one Change per put or delete after it
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ...errors import KvBridgeError

__all__ = ["Store", "Entry", "Snapshot", "Change", "StoreUnavailable", "Conflict"]


class StoreUnavailable(KvBridgeError):
    """The store could not be reached (or did not answer) within the call's deadline."""


class Conflict(KvBridgeError):
    """A conditional set found the key in another state; `current` is what is there (None: nothing)."""

    def __init__(self, key: str, current: Entry | None) -> None:
        super().__init__(f"{key}: " + ("exists" if current else "does not exist") +
                         (f" (revision {current.revision})" if current else ""))
        self.key, self.current = key, current


@dataclass(frozen=True)
class Entry:
    key: str
    value: str
    revision: int       # the revision of the key's last modification
    lease: str = ""     # "" when not bound to a lease


@dataclass(frozen=True)
class Snapshot:
    revision: int
    entries: dict[str, Entry]


@dataclass(frozen=True)
class Change:
    kind: str           # "put" or "delete"
    key: str
    value: str          # "" for a delete
    revision: int


class Store(abc.ABC):
    """A key-value store with leases and prefix watches (see the module docstring)."""

    uri: str = ""

    @abc.abstractmethod
    async def set(self, key: str, value: str, ttl_s: float, prev_revision: int | None = None) -> tuple[str, int]:
        ...

    @abc.abstractmethod
    async def refresh(self, lease: str) -> bool:
        ...

    @abc.abstractmethod
    async def revoke(self, lease: str) -> None:
        ...

    @abc.abstractmethod
    async def get(self, key: str) -> Entry | None:
        ...

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        ...

    @abc.abstractmethod
    async def list(self, prefix: str) -> dict[str, Entry]:
        ...

    @abc.abstractmethod
    def watch(self, prefix: str) -> AsyncIterator[Snapshot | Change]:
        ...

    async def close(self) -> None:
        """Release connections (no-op by default)."""
