"""kvbridge.kvcache: the paged KV cache of one rank, shared by every engine-side part of kvbridge.

Modules:
    manager       the pool tensor of one rank, block allocation per request, pinning, block reuse
                  (TensorRT-LLM's KVCacheManager method names)
    prefix_tree   reusable full blocks under chained block keys; `chain_keys` is what a router computes too

Sits on formatter (the layout); imports nothing of transceiver, executor or serving. The reference executor,
TensorRT-LLM's names (kvbridge.trtllm) and the router's KV index use it.
"""
