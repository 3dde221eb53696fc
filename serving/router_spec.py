"""The `router:` section of the serving config: where the router listens, how it picks workers, and the
deadline of every hop (RouterSpec), parsed and validated key by key.

Never starts the router (router.py does) and never touches the network.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ServeConfigError
from .config_keys import get_key as _get
from .config_keys import known_keys as _known

__all__ = ["KV_AWARE_DEFAULTS", "POLICIES", "RouterSpec", "api_keys", "parse_kv_aware", "parse_router"]

KV_AWARE_DEFAULTS: dict[str, float] = {"prefill_weight": 1.0, "load_weight": 0.5, "request_weight": 1.0,
                                       "pull_weight": 1.0, "decode_weight": 2.0, "spec_ttl_s": 2.0,
                                       "max_index_entries": 1_000_000, "replay_timeout_s": 5.0,
                                       "local_prefill_tokens": 0}

POLICIES = ("round_robin", "least_loaded", "prefix_aware", "kv_aware")
_ROUTER = {"host", "port", "bind_host", "policy", "request_timeout_s", "context_timeout_s",
           "health_interval_s", "health_timeout_s", "health_failures", "connect_timeout_s", "api_keys",
           "overlap", "kv_aware", "insecure"}


@dataclass(frozen=True)
class RouterSpec:
    """The router: where it listens, how it picks workers, and the deadline of every hop."""

    host: str = "127.0.0.1"
    port: int = 8000
    bind_host: str = ""
    policy: str = "round_robin"
    request_timeout_s: float = 300.0   # a whole request, context hop + generation (streaming included)
    context_timeout_s: float = 120.0   # one context hop (a prefill); a failed hop is retried elsewhere
    health_interval_s: float = 2.0     # how often every worker's /health is polled
    health_timeout_s: float = 5.0      # one /health probe's deadline (serving/health.py)
    health_failures: int = 3           # consecutive missed probes before a worker is out (refused: at once)
    connect_timeout_s: float = 5.0     # opening a connection to a worker
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # /v1/*, /metrics need one (empty: open)
    overlap: bool = True               # tell the generation side of a request when its prefill starts
    kv_aware: dict = field(default_factory=dict)  # policy kv_aware's settings (serving/kv_policy.py)
    insecure: bool = False             # true: no API keys on a non-loopback bind_host (else refused)
    scheme: str = "http"               # https with the config's `tls:` (serving/tls.py)

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"



def parse_router(d: dict) -> RouterSpec:
    _known(d, _ROUTER, "router")
    r = RouterSpec(host=_get(d, "host", str, "router", "127.0.0.1"),
                   port=_get(d, "port", int, "router", 8000),
                   bind_host=_get(d, "bind_host", str, "router", ""),
                   policy=_get(d, "policy", str, "router", "round_robin"),
                   request_timeout_s=_get(d, "request_timeout_s", float, "router", 300.0),
                   context_timeout_s=_get(d, "context_timeout_s", float, "router", 120.0),
                   health_interval_s=_get(d, "health_interval_s", float, "router", 2.0),
                   health_timeout_s=_get(d, "health_timeout_s", float, "router", 5.0),
                   health_failures=_get(d, "health_failures", int, "router", 3),
                   connect_timeout_s=_get(d, "connect_timeout_s", float, "router", 5.0),
                   api_keys=api_keys(d.get("api_keys", [])),
                   overlap=_get(d, "overlap", bool, "router", True),
                   kv_aware=parse_kv_aware(d.get("kv_aware")),
                   insecure=_get(d, "insecure", bool, "router", False))
    if r.policy not in POLICIES:
        raise ServeConfigError(f"router.policy: {r.policy!r} is not one of {POLICIES}")
    if not 0 <= r.port < 65536:
        raise ServeConfigError(f"router.port: {r.port} is not a TCP port")
    if r.health_failures < 1:
        raise ServeConfigError(f"router.health_failures: must be >= 1, got {r.health_failures}")
    for k in ("request_timeout_s", "context_timeout_s", "health_interval_s", "health_timeout_s",
              "connect_timeout_s"):
        if getattr(r, k) <= 0:
            raise ServeConfigError(f"router.{k}: must be > 0 seconds, got {getattr(r, k)}")
    return r if r.bind_host else RouterSpec(**{**r.__dict__, "bind_host": r.host})


def parse_kv_aware(v: Any) -> dict:
    """router.kv_aware, validated (every value a number >= 0; the caps > 0)."""
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ServeConfigError("router.kv_aware: expected a mapping")
    out = {}
    for k, x in v.items():
        if k not in KV_AWARE_DEFAULTS:
            raise ServeConfigError(f"router.kv_aware.{k}: unknown key (known: {sorted(KV_AWARE_DEFAULTS)})")
        if isinstance(x, bool) or not isinstance(x, (int, float)) or x < 0:
            raise ServeConfigError(f"router.kv_aware.{k}: expected a number >= 0, got {x!r}")
        if k in ("max_index_entries", "replay_timeout_s") and x <= 0:
            raise ServeConfigError(f"router.kv_aware.{k}: must be > 0")
        out[k] = x
    return out


def api_keys(v: Any) -> tuple[str, ...]:
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(k, str) and k.strip() for k in v):
        raise ServeConfigError("router.api_keys: expected a list of non-empty strings")
    return tuple(k.strip() for k in v)
