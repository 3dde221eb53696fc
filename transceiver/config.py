"""Transceiver settings: endpoints, agent preference, every timeout, in one validated dataclass, and
TensorRT-LLM's `cache_transceiver_config` (with its TRTLLM_* environment switches) mapped onto it.

All durations are seconds. Every wait in the transceiver is bounded by one of these. Owns both vocabularies
in one module, because each converts into the other (`TransceiverConfig.from_dict` accepts the upstream
mapping, `CacheTransceiverConfig.to_transceiver_config` builds a TransceiverConfig); `upstream.py` is the
import path `kvbridge.trtllm` uses for the upstream names. Refuses, by name, what kvbridge cannot do (the MPI
backend). Never reads anything but the mapping and the environment it is given.

TensorRT-LLM's names:
    backend                               DEFAULT | UCX | NIXL -> agents ("nixl",): NIXL over UCX is what
                                          kvbridge moves host and device memory with. MPI -> ConfigError.
    max_tokens_in_buffer                  -> staging_arena_bytes (tokens x bytes per token of one rank),
                                          when the layout is known; kept otherwise.
    kv_transfer_timeout_ms                -> transfer_timeout_s and pickup_timeout_s (ms / 1000)
    kv_transfer_sender_future_timeout_ms  -> the bound of one context-side status wait (kvbridge.trtllm)
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from typing import Any, Mapping

from ..errors import KvBridgeError

__all__ = ["Backend", "CacheTransceiverConfig", "ConfigError", "ENV_SWITCHES", "TransceiverConfig", "UPSTREAM_KEYS",
           "is_upstream", "local_host_id", "portable"]


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
    handshake_timeout_s: Hello -> Welcome bound; also how long a context peer's dropped connection may stay
        down (with requests in flight) before they fail as PeerGone.
    publish_wait_s: how long a context rank keeps a Fetch that came before its request's publish (an early
        decode whose prefill is still queued) before answering that it has no such request; None: the
        handshake_timeout_s.
    drain_timeout_s: after a failure, how long cancelled reads get to settle; past it the pull is quarantined
        (reported only once its reads settle, its blocks held) for at most quarantine_s.
    stream_layers: ask context ranks to push LayersReady and read layer ranges as they become ready.
    staging_arena_bytes: per-rank scratch for the staged path (0: off). A piece whose direct plan is at least
        staging_min_fragments fragments of mean size below staging_threshold_bytes is packed by the context
        rank, read as one descriptor and unpacked by the generation rank (transceiver/staging.py); when either
        arena is full the read goes direct.
    staging_memory: where the staging arena lives. "device" (default): on the pool's device (VRAM for GPU
        pools). "host": pinned host memory (numpy for host pools); then EVERY piece is staged when both sides
        have an arena with room, not only many-small-fragment ones, so the wire never carries device memory
        (for transports that move host memory far faster than GPU memory, e.g. UCX over TCP). Packing goes
        layer range by layer range as layers become ready (stream_layers). Agents that cannot register host
        memory (cuda_ipc) are not used for such a pool. See docs/staging.md.
    verify: after reading, both sides hash what they hold (xxh3-64 per layer, canonical order) and compare;
        a mismatch fails the transfer with IntegrityError. Costs a gather and a hash on both sides.
    curve_secret_key_file / curve_public_key_file / curve_server_public_key_file /
    curve_authorized_keys_dir: CurveZMQ authentication and encryption of the control plane. Without them a
        context rank binds loopback only (bind_host 127.0.0.1 / ::1 / localhost).
    insecure: allow a context rank without CurveZMQ keys to bind a non-loopback address (anyone who reaches it
        can read its KV pool); logged as a WARNING at start-up. Off unless the config says `insecure: true`.
    max_sessions: most generation-rank sessions (handshaken peers) a context rank keeps at once; an extra Hello
        gets an error. Sessions of peers silent for peer_timeout_s without a pull in flight are dropped.
    read_ahead: a generation rank whose DisaggParams carry the context block ids posts its reads together with
        its Fetch (one round trip fewer; see DisaggParams.ctx_block_ids). Off: such params are pulled the
        classic way (Fetch, Blocks, reads).
    options: per-agent constructor options, {kind: {name: value}}, for every rank of this config.
    rank_options: the same for one rank only, {rank: {kind: {name: value}}}, merged over `options` (rank as
        the layout numbers it: pp_rank * tp + tp_rank). E.g. two generation ranks sharing one GPU, reading
        from a context rank on another: `rank_options: {1: {cuda_ipc: {launch_on: peer}}}` runs rank 1's copy
        kernel on the context's GPU, so the two reads stop taking turns on the shared one (docs/direct-path.md).
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
    publish_wait_s: float | None = None
    drain_timeout_s: float = 5.0
    quarantine_s: float = 600.0
    stream_layers: bool = False
    verify: bool = False
    staging_arena_bytes: int = 0
    staging_threshold_bytes: int = 32 << 10
    staging_min_fragments: int = 64
    staging_memory: str = "device"
    curve_secret_key_file: str | None = None
    curve_public_key_file: str | None = None
    curve_server_public_key_file: str | None = None
    curve_authorized_keys_dir: str | None = None
    insecure: bool = False
    max_sessions: int = 1024
    read_ahead: bool = True
    options: dict[str, Any] = field(default_factory=dict)  # per-agent constructor options: {kind: {...}}
    rank_options: dict[int, dict[str, dict[str, Any]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", _kind_options(self.options, "transceiver.options"))
        object.__setattr__(self, "rank_options", _rank_options(self.rank_options))
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
        if self.publish_wait_s is not None and (isinstance(self.publish_wait_s, bool) or not isinstance(
                self.publish_wait_s, (int, float)) or self.publish_wait_s <= 0):
            raise ConfigError(f"transceiver.publish_wait_s must be a positive number of seconds, got "
                              f"{self.publish_wait_s!r}")
        if self.heartbeat_s * 2 > self.lease_s:
            raise ConfigError(f"transceiver.heartbeat_s ({self.heartbeat_s}) must be at most half of lease_s "
                              f"({self.lease_s}) so a lease is renewed before it runs out")
        if self.staging_arena_bytes < 0 or self.staging_threshold_bytes < 0 or self.staging_min_fragments < 0:
            raise ConfigError("transceiver.staging_* settings must not be negative")
        if self.staging_memory not in ("device", "host"):
            raise ConfigError(f"transceiver.staging_memory must be 'device' or 'host', got {self.staging_memory!r}")
        for f in ("insecure", "read_ahead"):
            if not isinstance(getattr(self, f), bool):
                raise ConfigError(f"transceiver.{f} must be true or false, got {getattr(self, f)!r}")
        if not isinstance(self.max_sessions, int) or isinstance(self.max_sessions, bool) or self.max_sessions < 1:
            raise ConfigError(f"transceiver.max_sessions must be a positive integer, got {self.max_sessions!r}")
        if not 0 <= int(self.port) < 65536:
            raise ConfigError(f"transceiver.port {self.port} is not a TCP port")

    def agent_options(self, kind: str, rank: int) -> dict[str, Any]:
        """Constructor options of agent `kind` for `rank`: `options`, then that rank's `rank_options` over them."""
        return {**self.options.get(kind, {}), **self.rank_options.get(rank, {}).get(kind, {})}

    @property
    def publish_wait(self) -> float:
        """Seconds a Fetch may wait for its request's publish."""
        return float(self.publish_wait_s if self.publish_wait_s is not None else self.handshake_timeout_s)

    @property
    def host(self) -> str:
        return self.advertise_host or self.bind_host

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "TransceiverConfig":
        """Build from a config file's mapping (or TensorRT-LLM's cache_transceiver_config, below);
        unknown keys are an error that names them."""
        d = dict(d or {})
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


def _kind_options(v: Any, what: str) -> dict[str, dict[str, Any]]:
    """{kind: {name: value}} checked (a copy), naming what is wrong."""
    if not isinstance(v, Mapping):
        raise ConfigError(f"{what} must map agent kinds to their options, got {type(v).__name__}")
    for kind, opts in v.items():
        if not isinstance(kind, str) or not isinstance(opts, Mapping):
            raise ConfigError(f"{what}[{kind!r}] must be an agent kind mapped to its options, got "
                              f"{type(opts).__name__}")
        bad = [k for k in opts if not isinstance(k, str)]
        if bad:
            raise ConfigError(f"{what}[{kind!r}] option names must be strings, got {bad}")
    return {kind: dict(opts) for kind, opts in v.items()}


def _rank_options(v: Any) -> dict[int, dict[str, dict[str, Any]]]:
    """{rank: {kind: {name: value}}}; ranks may come as digit strings (JSON keys)."""
    if not isinstance(v, Mapping):
        raise ConfigError(f"transceiver.rank_options must map ranks to agent options, got {type(v).__name__}")
    out = {}
    for rank, opts in v.items():
        r = int(rank) if isinstance(rank, str) and rank.isascii() and rank.isdigit() else rank
        if not isinstance(r, int) or isinstance(r, bool) or r < 0:
            raise ConfigError(f"transceiver.rank_options: {rank!r} is not a rank (a non-negative integer)")
        if r in out:
            raise ConfigError(f"transceiver.rank_options names rank {r} twice")
        out[r] = _kind_options(opts, f"transceiver.rank_options[{r}]")
    return out


def portable(d: Mapping[str, Any] | None) -> dict[str, Any]:
    """A TransceiverConfig mapping with rank_options' ranks as strings: msgpack (strict map keys, as kvbridge
    reads every peer's bytes) and JSON take string keys only; `from_dict` reads them back as ranks."""
    d = dict(d or {})
    if isinstance(d.get("rank_options"), Mapping):
        d["rank_options"] = {str(k): v for k, v in d["rank_options"].items()}
    return d


def local_host_id() -> str:
    """hostname + boot id: equal exactly for processes of one host (used to prefer intra-node agents)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


# --- TensorRT-LLM's names ---------------------------------------------------------------------------
UPSTREAM_KEYS = frozenset({"backend", "max_tokens_in_buffer", "kv_transfer_timeout_ms",
                           "kv_transfer_sender_future_timeout_ms", "transceiver_runtime"})


class Backend(Enum):
    """TensorRT-LLM's CacheTransceiverBackendType names."""

    DEFAULT = "DEFAULT"
    UCX = "UCX"
    NIXL = "NIXL"
    MPI = "MPI"


# TRTLLM_* switches: what each means here. "backend" ones choose the backend under `backend: DEFAULT`;
# "no effect" ones describe something kvbridge always does (or never needs), so they are accepted as set.
ENV_SWITCHES: dict[str, str] = {
    "TRTLLM_USE_UCX_KVCACHE": "backend UCX under DEFAULT (nixl agent over UCX)",
    "TRTLLM_USE_NIXL_KVCACHE": "backend NIXL under DEFAULT (nixl agent)",
    "TRTLLM_USE_MPI_KVCACHE": "backend MPI under DEFAULT: refused (kvbridge has no MPI transport)",
    "TRTLLM_KVCACHE_TRANSFER_BUFFER_SIZE": "staging_arena_bytes when max_tokens_in_buffer is unset "
                                           "(bytes, or with KB/MB/GB)",
    "TRTLLM_PARALLEL_CACHE_SEND": "no effect: the context side always serves requests concurrently",
    "TRTLLM_ENABLE_KVCACHE_RECEIVE_PARALLEL": "no effect: a pull always reads every context rank at once",
    "TRTLLM_REQUEST_KV_CACHE_CONCURRENT": "no effect: pulls of different requests always run concurrently",
    "TRTLLM_DISABLE_KV_CACHE_TRANSFER_OVERLAP": "no effect: use request_and_receive_sync for no overlap",
    "TRTLLM_TRY_ZCOPY_FOR_KVCACHE_TRANSFER": "no effect: reads go straight into the pool (zero copy) "
                                             "unless staging helps",
    "TRTLLM_KVCACHE_TRANSFER_USE_ASYNC_BUFFER": "no effect: no transfer buffer is allocated per request",
    "TRTLLM_KVCACHE_SEND_MAX_CONCURRENCY_NUM": "no effect: the send side has no per-request buffers to bound",
}
_UNITS = {"": 1, "B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}


def _on(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "0").strip() not in ("", "0", "false", "False", "no", "off")


def _size(text: str, name: str) -> int:
    t = text.strip().upper()
    digits = t.rstrip("KMGB")
    unit = t[len(digits):]
    if not digits.isdigit() or unit not in _UNITS:
        raise ConfigError(f"{name}={text!r} is not a byte size (e.g. 536870912 or 512MB)")
    return int(digits) * _UNITS[unit]


def _opt_int(d: Mapping[str, Any], key: str, positive: bool) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < (1 if positive else 0):
        kind = "positive" if positive else "non-negative"
        raise ConfigError(f"cache_transceiver_config.{key}: expected a {kind} integer or null, got {v!r}")
    return v


@dataclass(frozen=True)
class CacheTransceiverConfig:
    """TensorRT-LLM's cache transceiver settings (every field defaults to None, as upstream).

    Attributes:
        backend: DEFAULT, UCX, NIXL or MPI (any case); None means DEFAULT.
        max_tokens_in_buffer: tokens the transfer buffer holds (kvbridge: the staging arena).
        kv_transfer_timeout_ms: a transfer's deadline (kvbridge: transfer and pickup timeouts).
        kv_transfer_sender_future_timeout_ms: one context-side status wait's bound.
    """

    backend: Backend | None = None
    max_tokens_in_buffer: int | None = None
    kv_transfer_timeout_ms: int | None = None
    kv_transfer_sender_future_timeout_ms: int | None = None

    def __post_init__(self) -> None:
        b = self.backend
        if isinstance(b, str):
            try:
                object.__setattr__(self, "backend", Backend(b.upper()))
            except ValueError:
                raise ConfigError(f"cache_transceiver_config.backend: {b!r} is not one of "
                                  f"{[x.value for x in Backend]}") from None
        elif b is not None and not isinstance(b, Backend):
            raise ConfigError(f"cache_transceiver_config.backend: expected a string, got {b!r}")
        d = {k: getattr(self, k) for k in ("max_tokens_in_buffer", "kv_transfer_timeout_ms",
                                           "kv_transfer_sender_future_timeout_ms")}
        _opt_int(d, "max_tokens_in_buffer", positive=True)
        _opt_int(d, "kv_transfer_timeout_ms", positive=True)
        _opt_int(d, "kv_transfer_sender_future_timeout_ms", positive=True)
        if self.backend is Backend.MPI:
            raise ConfigError("cache_transceiver_config.backend: MPI is not supported by kvbridge (it moves "
                              "KV with a NIXL/UCX agent); use UCX, NIXL or DEFAULT")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "CacheTransceiverConfig":
        """From a `cache_transceiver_config` mapping; unknown keys are an error naming them."""
        d = dict(d or {})
        runtime = d.pop("transceiver_runtime", None)
        if runtime not in (None, "CPP", "PYTHON"):
            raise ConfigError(f"cache_transceiver_config.transceiver_runtime: {runtime!r} is not CPP or "
                              f"PYTHON")
        unknown = sorted(set(d) - UPSTREAM_KEYS)
        if unknown:
            raise ConfigError(f"cache_transceiver_config.{unknown[0]}: unknown key; known: "
                              f"{sorted(UPSTREAM_KEYS)}")
        return cls(**d)

    def resolved_backend(self, env: Mapping[str, str] | None = None) -> Backend:
        """The backend after DEFAULT is resolved by the environment switches (NIXL when none is set)."""
        env = os.environ if env is None else env
        if self.backend not in (None, Backend.DEFAULT):
            return self.backend
        if _on(env, "TRTLLM_USE_MPI_KVCACHE"):
            raise ConfigError("TRTLLM_USE_MPI_KVCACHE=1 asks for the MPI backend, which kvbridge does not "
                              "support; unset it (or set backend: UCX or NIXL)")
        return Backend.UCX if _on(env, "TRTLLM_USE_UCX_KVCACHE") else Backend.NIXL

    def settings(self, bytes_per_token: int | None = None,
                 env: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The TransceiverConfig settings this maps to (a from_dict mapping)."""
        env = os.environ if env is None else env
        self.resolved_backend(env)  # refuses MPI by name
        out: dict[str, Any] = {"agents": ["nixl"]}
        if self.kv_transfer_timeout_ms is not None:
            out["transfer_timeout_s"] = out["pickup_timeout_s"] = self.kv_transfer_timeout_ms / 1000.0
        if self.max_tokens_in_buffer is not None and bytes_per_token:
            out["staging_arena_bytes"] = self.max_tokens_in_buffer * int(bytes_per_token)
        elif self.max_tokens_in_buffer is None and env.get("TRTLLM_KVCACHE_TRANSFER_BUFFER_SIZE"):
            out["staging_arena_bytes"] = _size(env["TRTLLM_KVCACHE_TRANSFER_BUFFER_SIZE"],
                                               "TRTLLM_KVCACHE_TRANSFER_BUFFER_SIZE")
        return out

    def to_transceiver_config(self, bytes_per_token: int | None = None, env: Mapping[str, str] | None = None,
                              **overrides: Any) -> TransceiverConfig:
        """kvbridge's TransceiverConfig (overrides: any other TransceiverConfig field)."""
        return TransceiverConfig.from_dict({**self.settings(bytes_per_token, env), **overrides})

    def to_dict(self) -> dict[str, Any]:
        return {"backend": None if self.backend is None else self.backend.value,
                "max_tokens_in_buffer": self.max_tokens_in_buffer,
                "kv_transfer_timeout_ms": self.kv_transfer_timeout_ms,
                "kv_transfer_sender_future_timeout_ms": self.kv_transfer_sender_future_timeout_ms}


def is_upstream(d: Mapping[str, Any]) -> bool:
    """Whether a transceiver mapping uses TensorRT-LLM's keys (and none of kvbridge's own)."""
    return bool(d) and set(d) <= UPSTREAM_KEYS
