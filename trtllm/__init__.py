"""kvbridge.trtllm: TensorRT-LLM's names over kvbridge (no TensorRT-LLM import needed).

Modules:
    llm_request       LlmRequest (the fields kvbridge reads) and LlmRequestState, upstream names
    kv_cache_manager  KVCacheManager with upstream's constructor and scheduled-batch methods
    transceiver       KvCacheTransceiver with upstream's method set and state moves
    serve_config      a `trtllm-serve disaggregated -c` config translated into kvbridge's serving config

An engine adapter: sits on transceiver, kvcache, formatter and agents, and never imports the reference
executor (nor serving). TensorRT-LLM's KV Cache Connector API, which runs connectors written for TensorRT-LLM
inside the reference executor, is the executor's: kvbridge.executor.connector.trtllm_api (and its example,
trtllm_example).
"""

from importlib import import_module

# Imported on first use, so serving/config.py's hook (serve_config) does not load torch into the router.
_WHERE = {
    "Backend": "..transceiver.upstream", "CacheTransceiverConfig": "..transceiver.upstream",
    "CacheType": ".kv_cache_manager", "KVCacheManager": ".kv_cache_manager",
    "KvCacheConfig": ".kv_cache_manager",
    "Mapping": ".kv_cache_manager", "ScheduledRequests": ".kv_cache_manager",
    "LlmRequest": ".llm_request", "LlmRequestState": ".llm_request", "LlmRequestType": ".llm_request",
    "KvCacheTransceiver": ".transceiver", "create_kv_cache_transceiver": ".transceiver",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_WHERE[name], __name__), name)
