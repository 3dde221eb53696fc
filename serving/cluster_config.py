"""The `disagg_cluster` section of a serving config: workers join and leave through a registry instead of a
static list of URLs (TensorRT-LLM's `trtllm-serve` key of the same name and fields).

    disagg_cluster:
      cluster_uri: http://127.0.0.1:8000   # the router is the registry (default), or etcd://host:2379
                                           # (etcd://USER@host:2379: etcd's auth, password below)
      etcd_password_file: null             # kvbridge: USER's password (else $KVBRIDGE_ETCD_PASSWORD)
      cluster_name: kvbridge               # one registry may hold several deployments
      minimal_instances: {context_servers: 1, generation_servers: 1}   # 503 + Retry-After until up
      heartbeat_interval_sec: 2            # a worker refreshes its lease this often ...
      inactive_interval_sec: 10            # ... which lapses (the worker vanishes) after this long
      drain_timeout_sec: 30                # kvbridge: SIGTERM waits this long for in-flight requests

Validated here, every error naming its key (`disagg_cluster.heartbeat_interval_sec: ...`); the rule that a
heartbeat fits at least twice into the TTL, and that each heartbeat call's own deadline is half an interval,
is what keeps a live worker from being evicted by one slow call. Never opens a connection.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ..errors import ServeConfigError

__all__ = ["ClusterSpec", "parse_cluster", "KEYS", "ETCD_PASSWORD_ENV"]

KEYS = {"cluster_uri", "cluster_name", "minimal_instances", "heartbeat_interval_sec", "inactive_interval_sec",
        "drain_timeout_sec", "etcd_password_file"}
ETCD_PASSWORD_ENV = "KVBRIDGE_ETCD_PASSWORD"
_MINIMAL = {"context_servers": "context", "generation_servers": "generation"}


@dataclass(frozen=True)
class ClusterSpec:
    uri: str
    name: str = "kvbridge"
    minimal: tuple[tuple[str, int], ...] = (("context", 1), ("generation", 1))
    heartbeat_s: float = 2.0
    ttl_s: float = 10.0
    drain_s: float = 30.0
    etcd_password_file: str | None = None

    @property
    def scheme(self) -> str:
        return urlsplit(self.uri).scheme

    @property
    def router_registry(self) -> bool:
        """The router holds the registry (http:// or https://, as the router speaks), not etcd."""
        return self.scheme in ("http", "https")

    @property
    def etcd_user(self) -> str | None:
        return urlsplit(self.uri).username if self.scheme == "etcd" else None

    def etcd_password(self) -> str | None:
        """The etcd user's password: $KVBRIDGE_ETCD_PASSWORD, else etcd_password_file's first line (None
        without a user). Read when the store opens, never logged; ServeConfigError naming both sources when
        neither has it."""
        if self.etcd_user is None:
            return None
        if os.environ.get(ETCD_PASSWORD_ENV):
            return os.environ[ETCD_PASSWORD_ENV]
        if self.etcd_password_file:
            try:
                with open(self.etcd_password_file, encoding="utf-8") as f:
                    pw = f.readline().rstrip("\r\n")
            except OSError as e:
                raise ServeConfigError(f"disagg_cluster.etcd_password_file: cannot read it: {e}") from None
            if pw:
                return pw
        raise ServeConfigError(f"disagg_cluster.cluster_uri names etcd user {self.etcd_user!r} but no password: "
                               f"set {ETCD_PASSWORD_ENV} or disagg_cluster.etcd_password_file")

    @property
    def call_timeout_s(self) -> float:
        """The deadline of one registry call: half a heartbeat, so a slow call never costs the lease."""
        return max(0.2, self.heartbeat_s / 2)

    def minimal_of(self, role: str) -> int:
        return dict(self.minimal).get(role, 0)


def parse_cluster(d: Any, router_host: str, router_port: int, tls: bool = False) -> ClusterSpec:
    """Validate a `disagg_cluster` mapping. `router_host/port` are the router's (an http:// cluster_uri must
    name the router; https:// with the config's `tls`, which makes the default https:// too)."""
    if not isinstance(d, dict):
        raise ServeConfigError(f"disagg_cluster: expected a mapping, got {type(d).__name__}")
    bad = sorted(str(k) for k in d if k not in KEYS)
    if bad:
        raise ServeConfigError(f"disagg_cluster.{bad[0]}: unknown key; known keys: {sorted(KEYS)}")
    web = "https" if tls else "http"  # the router as registry speaks what the router speaks
    uri = d.get("cluster_uri", f"{web}://{router_host}:{router_port}")
    if not isinstance(uri, str):
        raise ServeConfigError(f"disagg_cluster.cluster_uri: expected a string, got {uri!r}")
    u = urlsplit(uri)
    if u.scheme not in (web, "etcd") or not u.hostname:
        raise ServeConfigError(f"disagg_cluster.cluster_uri: {uri!r} is not {web}://<router host:port> or "
                               f"etcd://<host:port>" + (" (the config has tls: the router speaks https)" if tls
                                                        and u.scheme == "http" else ""))
    try:
        u.port
    except ValueError:
        raise ServeConfigError(f"disagg_cluster.cluster_uri: {uri!r} has a bad port") from None
    if u.password is not None or (u.username is not None and u.scheme != "etcd"):
        raise ServeConfigError("disagg_cluster.cluster_uri: only etcd://USER@host:port may carry "
                               f"credentials, and never a password: put it in {ETCD_PASSWORD_ENV} or "
                               f"disagg_cluster.etcd_password_file")
    pw_file = d.get("etcd_password_file")
    if pw_file is not None and (not isinstance(pw_file, str) or not pw_file or u.username is None):
        raise ServeConfigError("disagg_cluster.etcd_password_file: a path, and only with an etcd user in "
                               "cluster_uri (etcd://USER@host:port)")
    name = d.get("cluster_name", "kvbridge")
    if not isinstance(name, str) or not name or not all(c.isalnum() or c in "-_." for c in name):
        raise ServeConfigError(f"disagg_cluster.cluster_name: {name!r} must be a non-empty name of letters, "
                               f"digits, '-', '_' or '.'")
    num = {k: _num(d, k, dflt) for k, dflt in (("heartbeat_interval_sec", 2.0), ("inactive_interval_sec", 10.0),
                                                ("drain_timeout_sec", 30.0))}
    hb, ttl = num["heartbeat_interval_sec"], num["inactive_interval_sec"]
    if ttl < 2 * hb:
        raise ServeConfigError(f"disagg_cluster.inactive_interval_sec: {ttl:g}s must be at least twice "
                               f"heartbeat_interval_sec ({hb:g}s), so one late heartbeat does not evict a "
                               f"live worker")
    if u.scheme == "etcd" and ttl < 2:
        raise ServeConfigError("disagg_cluster.inactive_interval_sec: etcd leases last at least 2 s")
    spec = ClusterSpec(uri.rstrip("/"), name, _minimal(d.get("minimal_instances")), hb, ttl,
                       num["drain_timeout_sec"], pw_file)
    spec.etcd_password()  # a user without a password is refused now, not at the first registry call
    return spec


def _num(d: dict, k: str, default: float) -> float:
    v = d.get(k, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ServeConfigError(f"disagg_cluster.{k}: expected seconds > 0, got {v!r}")
    return float(v)


def _minimal(v: Any) -> tuple[tuple[str, int], ...]:
    if v is None:
        return (("context", 1), ("generation", 1))
    if type(v) is int:  # one number for both roles
        v = {"context_servers": v, "generation_servers": v}
    if not isinstance(v, dict):
        raise ServeConfigError("disagg_cluster.minimal_instances: expected {context_servers: N, "
                               "generation_servers: M} or one integer")
    out = []
    for k, n in v.items():
        if k not in _MINIMAL:
            raise ServeConfigError(f"disagg_cluster.minimal_instances.{k}: unknown key; known keys: "
                                   f"{sorted(_MINIMAL)}")
        if type(n) is not int or n < 0:
            raise ServeConfigError(f"disagg_cluster.minimal_instances.{k}: expected an integer >= 0, got {n!r}")
        out.append((_MINIMAL[k], n))
    have = dict(out)
    return tuple((r, have.get(r, 1)) for r in ("context", "generation"))
