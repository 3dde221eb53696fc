"""kvbridge.executor: a small, honest reference engine to produce and consume real, sharded KV caches.

Modules (lowest first):
XX
    kv_io             a request's KV out of / into pools, sharded and assembled across ranks (tests, tools)
    config            model shapes, seeded presets, the KV layout of a model under a TP/PP split
    weights           seeded weights and TP/PP sharding; gguf_model / hf_model / sources: other weights
    tokenizer         GGUF byte-level BPE and chat template
    text              the one text codec (prompts, chat, streamed detokenization), also used by serving
    model             one rank's slice of a Llama-family decoder with paged attention
    sampling          greedy and seeded sampling
    comm              process groups, TP all-reduce, PP send/recv, step-plan broadcast (every wait bounded)
    engine            the leader's scheduler: continuous batching; aggregated / context-only / generation-only
    hooks             the transceiver's seat in every rank process (calls, reports, all-rank consensus)
    worker, launch    the rank processes and their step loop
    runtime           `Executor`: the in-process handle that launches ranks and drives the engine
    generate          the `kvbridge generate` command
Its paged KV pool is kvbridge.kvcache (shared with TensorRT-LLM's names and the router's index).
Imports nothing above it (transceiver code reaches the executor through hooks.py, never the other way round).
"""
