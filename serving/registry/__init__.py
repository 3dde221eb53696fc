"""Cluster membership storage: one small Store interface (store.py) with two backends that really run,
chosen by `disagg_cluster.cluster_uri`:

    http://<router host:port>   the router holds the registry in memory (memory.py) and serves it to the
                                workers (http_store.py); nothing extra to start. The default.
    etcd://<host:port>          a real etcd server (etcd_store.py; the `kvbridge[etcd]` extra). Several routers
                                may share one etcd cluster.

Values are signed worker registrations (records.py). Never decides routing (serving/membership.py does).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from .records import RegistrationRefused, WorkerRecord, registry_key
from .store import Change, Conflict, Entry, Snapshot, Store, StoreUnavailable

__all__ = ["open_store", "Store", "Entry", "Snapshot", "Change", "Conflict", "StoreUnavailable",
           "RegistrationRefused", "WorkerRecord", "registry_key", "SCHEMES"]

SCHEMES = ("http", "https", "etcd")


def open_store(uri: str, key: bytes, call_timeout_s: float, etcd_password: str | None = None,
               verify: Any = True) -> Store:
    """The client Store of a cluster_uri (a worker's view; the router of an http(s):// registry holds a
    MemoryStore instead). etcd://USER@host:port logs in as USER with `etcd_password`; https:// checks the
    router's certificate with `verify` (httpx's: the deployment's CA context, serving/tls.py)."""
    u = urlsplit(uri)
    if u.scheme in ("http", "https"):
        from .http_store import HttpStore

        return HttpStore(uri, key, call_timeout_s, verify)
    if u.scheme == "etcd":
        from .etcd_store import EtcdStore

        return EtcdStore(u.hostname or "127.0.0.1", u.port or 2379, call_timeout_s, u.username, etcd_password)
    raise ValueError(f"cluster_uri {uri!r}: the scheme is not one of {SCHEMES}")
