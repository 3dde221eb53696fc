"""kvbridge.executor: a small, honest reference engine to produce and consume real, sharded KV caches.

Modules:
    kv_cache_manager  the paged pool of one rank (TensorRT-LLM's KVCacheManager interface) and pinning
    config            model shapes and seeded presets
    weights           weight sources (seeded, GGUF, safetensors) and TP/PP sharding
    model             a Llama-family decoder stage with paged attention
    engine            the leader's scheduler (continuous batching; aggregated / context-only / generation-only)
    worker            the per-rank loop that runs the leader's step plans
    runtime           `Executor`: the in-process handle that launches ranks and drives the engine
    generate          the `kvbridge generate` command
Imports nothing above it (transceiver code reaches the executor, never the other way round).
"""
