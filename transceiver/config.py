"""Transceiver settings: endpoints, agent preference, every timeout, in one validated dataclass.

All durations are seconds. Every wait in the transceiver is bounded by one of these.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ..errors import KvBridgeError

__all__ = ["TransceiverConfig", "ConfigError", "local_host_id"]


class ConfigError(KvBridgeError):
    """A configuration value is invalid; the message names it."""


@dataclass(frozen=True)
class TransceiverConfig:
    """Settings of one rank's transceiver.

    agents: transfer agent kinds in preference order; "auto" means cuda_ipc (GPU pools, same host, peer
        access works) then nixl. The generation side picks the first kind both sides offer that connects.
    bind_host / advertise_host / port: where the context side's control socket listens (port 0: any free
        port) and the address peers are told to use.
    transfer_timeout_s: the deadline of one generation-side pull, from submit to confirmed.
    pickup_timeout_s: how long a published context request stays pinned waiting for its first Fetch.
    lease_s: how long a context request stays pinned after the last sign of life from its readers.
    heartbeat_s: how often a reader renews its leases (must be well under lease_s).
    peer_timeout_s: silence from a context peer (with requests in flight) after which they fail.
    handshake_timeout_s: Hello -> Welcome bound.
    drain_timeout_s: after a failure, how long cancelled reads get to settle; past it the pull is quarantined
        (reported only once its reads settle, its blocks held) for at most quarantine_s.
    stream_layers: ask context ranks to push LayersReady and read layer ranges as they become ready.
    staging_arena_bytes: per-rank scratch for the staged path (0: off). A piece whose direct plan is at least
        staging_min_fragments fragments of mean size below staging_threshold_bytes is packed by the context
        rank, read as one descriptor and unpacked by the generation rank (transceiver/staging.py); when either
        arena is full the read goes direct.
    verify: after reading, both sides hash what they hold (xxh3-64 per layer, canonical order) and compare;
        a mismatch fails the transfer with IntegrityError. Costs a gather and a hash on both sides.
    curve_secret_key_file / curve_public_key_file / curve_server_public_key_file /
    curve_authorized_keys_dir: CurveZMQ authentication and encryption of the control plane. Without them a
        context rank binds loopback only (bind_host 127.0.0.1 / ::1 / localhost).
    insecure: allow a context rank without CurveZMQ keys to bind a non-loopback address (anyone who reaches it
        can read its KV pool); logged as a WARNING at start-up. Off unless the config says `insecure: true`.
    max_sessions: most generation-rank sessions (handshaken peers) a context rank keeps at once; an extra Hello
        gets an error. Sessions of peers silent for peer_timeout_s without a pull in flight are dropped.
    """

    agents: tuple[str, ...] = ("auto",)
    bind_host: str = "127.0.0.1"
    advertise_host: str | None = None
    port: int = 0
    transfer_timeout_s: float = 60.0
    pickup_timeout_s: float = 120.0
    lease_s: float = 10.0
    heartbeat_s: float = 1.0
    peer_timeout_s: float = 5.0
    handshake_timeout_s: float = 10.0
    drain_timeout_s: float = 5.0
    quarantine_s: float = 600.0
    stream_layers: bool = False
    verify: bool = False
    staging_arena_bytes: int = 0
    staging_threshold_bytes: int = 32 << 10
    staging_min_fragments: int = 64
    curve_secret_key_file: str | None = None
    curve_public_key_file: str | None = None
    curve_server_public_key_file: str | None = None
    curve_authorized_keys_dir: str | None = None
    insecure: bool = False
    max_sessions: int = 1024
    options: dict[str, Any] = field(default_factory=dict)  # per-agent constructor options: {kind: {...}}

    def __post_init__(self) -> None:
        if isinstance(self.agents, str):
            object.__setattr__(self, "agents", (self.agents,))
        object.__setattr__(self, "agents", tuple(self.agents))
        if not self.agents:
            raise ConfigError("transceiver.agents must name at least one agent kind (or 'auto')")
        for f in ("transfer_timeout_s", "pickup_timeout_s", "lease_s", "heartbeat_s", "peer_timeout_s",
                  "handshake_timeout_s", "drain_timeout_s", "quarantine_s"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or v <= 0:
                raise ConfigError(f"transceiver.{f} must be a positive number of seconds, got {v!r}")
        if self.heartbeat_s * 2 > self.lease_s:
            raise ConfigError(f"transceiver.heartbeat_s ({self.heartbeat_s}) must be at most half of lease_s "
                              f"({self.lease_s}) so a lease is renewed before it runs out")
        if self.staging_arena_bytes < 0 or self.staging_threshold_bytes < 0 or self.staging_min_fragments < 0:
            raise ConfigError("transceiver.staging_* settings must not be negative")
        if not isinstance(self.insecure, bool):
            raise ConfigError(f"transceiver.insecure must be true or false, got {self.insecure!r}")
        if not isinstance(self.max_sessions, int) or isinstance(self.max_sessions, bool) or self.max_sessions < 1:
            raise ConfigError(f"transceiver.max_sessions must be a positive integer, got {self.max_sessions!r}")
        if not 0 <= int(self.port) < 65536:
            raise ConfigError(f"transceiver.port {self.port} is not a TCP port")

    @property
    def host(self) -> str:
        return self.advertise_host or self.bind_host

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "TransceiverConfig":
        """Build from a config file's mapping (or TensorRT-LLM's cache_transceiver_config, upstream.py);
        unknown keys are an error that names them."""
        d = dict(d or {})
        from .upstream import CacheTransceiverConfig, is_upstream  # TensorRT-LLM's cache_transceiver_config

        if is_upstream(d):
            d = CacheTransceiverConfig.from_dict(d).settings()
        if "agent" in d:  # single-agent shorthand: agent: nixl
            d["agents"] = d.pop("agent")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown transceiver settings {unknown}; known: {sorted(known)}")
        return cls(**d)

    def with_(self, **kw) -> "TransceiverConfig":
        return replace(self, **kw)


def local_host_id() -> str:
    """hostname + boot id: equal exactly for processes of one host (used to prefer intra-node agents)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"
