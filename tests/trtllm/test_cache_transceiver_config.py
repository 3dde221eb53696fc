"""TensorRT-LLM's cache_transceiver_config and TRTLLM_* switches map onto TransceiverConfig or are refused by name."""

from __future__ import annotations

import pytest

from kvbridge.transceiver.config import ConfigError, TransceiverConfig
from kvbridge.trtllm import Backend, CacheTransceiverConfig


def test_transceiver_config_from_dict_accepts_tensorrt_llm_fields():
    cfg = TransceiverConfig.from_dict({"backend": "UCX", "max_tokens_in_buffer": 8192,
                                       "kv_transfer_timeout_ms": 2500})
    assert cfg.agents == ("nixl",)
    assert cfg.transfer_timeout_s == cfg.pickup_timeout_s == 2.5


def test_defaults_are_upstream_nones_and_default_backend_resolves_to_nixl():
    c = CacheTransceiverConfig()
    assert c.to_dict() == {"backend": None, "max_tokens_in_buffer": None, "kv_transfer_timeout_ms": None,
                           "kv_transfer_sender_future_timeout_ms": None}
    assert c.resolved_backend({}) is Backend.NIXL
    assert c.resolved_backend({"TRTLLM_USE_UCX_KVCACHE": "1"}) is Backend.UCX
    assert CacheTransceiverConfig(backend="nixl").backend is Backend.NIXL  # older releases spelled it lowercase


def test_max_tokens_in_buffer_sizes_the_staging_arena_from_the_layout():
    c = CacheTransceiverConfig.from_dict({"backend": "DEFAULT", "max_tokens_in_buffer": 100})
    assert c.to_transceiver_config(bytes_per_token=512, env={}).staging_arena_bytes == 51200
    env = {"TRTLLM_KVCACHE_TRANSFER_BUFFER_SIZE": "2MB"}
    assert CacheTransceiverConfig().to_transceiver_config(env=env).staging_arena_bytes == 2 << 20


@pytest.mark.parametrize("make, match", [
    (lambda: CacheTransceiverConfig(backend="MPI"), r"backend: MPI is not supported"),
    (lambda: CacheTransceiverConfig().to_transceiver_config(env={"TRTLLM_USE_MPI_KVCACHE": "1"}),
     r"TRTLLM_USE_MPI_KVCACHE=1 asks for the MPI backend"),
    (lambda: CacheTransceiverConfig(backend="TCP"), r"backend: 'TCP' is not one of"),
    (lambda: CacheTransceiverConfig.from_dict({"kv_transfer_timeout_ms": 0}), r"kv_transfer_timeout_ms: expected"),
    (lambda: CacheTransceiverConfig.from_dict({"backend": "UCX", "max_num_tokens": 4}), r"max_num_tokens: unknown"),
    (lambda: CacheTransceiverConfig().to_transceiver_config(env={"TRTLLM_KVCACHE_TRANSFER_BUFFER_SIZE": "lots"}),
     r"TRTLLM_KVCACHE_TRANSFER_BUFFER_SIZE='lots' is not a byte size"),
], ids=["mpi", "mpi-env", "bad-backend", "zero-timeout", "unknown-key", "bad-size"])
def test_what_kvbridge_cannot_do_is_refused_naming_the_field(make, match):
    with pytest.raises(ConfigError, match=match):
        make()


def test_kvbridge_keys_beside_upstream_ones_are_not_mistaken_for_upstream():
    with pytest.raises(ConfigError, match="unknown transceiver settings"):
        TransceiverConfig.from_dict({"backend": "UCX", "lease_s": 3})
