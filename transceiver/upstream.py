"""TensorRT-LLM's `cache_transceiver_config` and its environment switches, mapped onto TransceiverConfig.

Owns the translation of TensorRT-LLM's names (llmapi `CacheTransceiverConfig`, `TRTLLM_*` variables) into
kvbridge's TransceiverConfig, and the refusal, by name, of what kvbridge cannot do (the MPI backend). Lives
in the transceiver layer so `TransceiverConfig.from_dict` can accept the upstream mapping; `kvbridge.trtllm`
re-exports it. Never reads anything but the mapping and the environment it is given.

    backend                               DEFAULT | UCX | NIXL -> agents ("nixl",): NIXL over UCX is what
                                          kvbridge moves host and device memory with. MPI -> ConfigError.
    max_tokens_in_buffer                  -> staging_arena_bytes (tokens x bytes per token of one rank),
                                          when the layout is known; kept otherwise.
    kv_transfer_timeout_ms                -> transfer_timeout_s and pickup_timeout_s (ms / 1000)
    kv_transfer_sender_future_timeout_ms  -> the bound of one context-side status wait (kvbridge.trtllm)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum
from typing import Any, Mapping

from .config import ConfigError, TransceiverConfig

__all__ = ["Backend", "CacheTransceiverConfig", "ENV_SWITCHES", "UPSTREAM_KEYS", "is_upstream"]

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
