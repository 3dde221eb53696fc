"""kvbridge.trtllm: TensorRT-LLM's names over kvbridge (no TensorRT-LLM import needed).

Modules:
    llm_request       LlmRequest (the fields kvbridge reads) and LlmRequestState, upstream names
    kv_cache_manager  KVCacheManager with upstream's constructor and scheduled-batch methods
    transceiver       KvCacheTransceiver with upstream's method set and state moves
    connector         KvCacheConnectorScheduler/Worker (built from llm_args) on kvbridge's executor
    persistent        PersistentKvCacheConnector: upstream's example connector, rewritten without pickle
    serve_config      a `trtllm-serve disaggregated -c` config translated into kvbridge's serving config

Sits beside serving: it may import executor, transceiver, formatter and agents; nothing below imports it.
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
    "KvCacheConnectorScheduler": ".connector", "KvCacheConnectorWorker": ".connector",
    "LlmArgs": ".connector",
    "RequestData": ".connector", "SchedulerOutput": ".connector", "kv_connector_config": ".connector",
    "mpi_rank": ".connector",
    "PersistentKvCacheConnectorLeader": ".persistent", "PersistentKvCacheConnectorWorker": ".persistent",
    "PersistentKvCacheConnectorMetadata": ".persistent",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_WHERE[name], __name__), name)
