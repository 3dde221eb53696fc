"""kvbridge.trtllm: TensorRT-LLM's names over kvbridge (no TensorRT-LLM import needed).

Modules:
    llm_request       LlmRequest (the fields kvbridge reads) and LlmRequestState, upstream names
    kv_cache_manager  KVCacheManager with upstream's constructor and scheduled-batch methods
    transceiver       KvCacheTransceiver with upstream's method set and state moves
    connector         KvCacheConnectorScheduler/Worker (built from llm_args) on kvbridge's executor
    persistent        PersistentKvCacheConnector: upstream's example connector, rewritten without pickle
    serve_config      a `trtllm-serve disaggregated -c` config translated into kvbridge's serving config
    check             `kvbridge serve --check CONFIG`

Sits beside serving: it may import executor, transceiver, formatter and agents; nothing below imports it.
"""

from ..transceiver.upstream import Backend, CacheTransceiverConfig
from .kv_cache_manager import CacheType, KVCacheManager, KvCacheConfig, Mapping, ScheduledRequests
from .llm_request import LlmRequest, LlmRequestState, LlmRequestType
from .transceiver import KvCacheTransceiver, create_kv_cache_transceiver

__all__ = ["Backend", "CacheTransceiverConfig", "CacheType", "KVCacheManager", "KvCacheConfig",
           "KvCacheTransceiver", "LlmRequest", "LlmRequestState", "LlmRequestType", "Mapping",
           "ScheduledRequests", "create_kv_cache_transceiver"]
