"""kvbridge.executor.connector: KV cache connectors (TensorRT-LLM's KV Cache Connector roles and hooks).

Modules:
    base        the contract: KvConnectorScheduler / KvConnectorWorker, their hooks, who calls them and when
    leader      the scheduler half's seat beside the engine (leader rank)
    rank        the worker half's seat in every rank process
    wire        the plan section down and the rank reports up (msgpack), the all-rank tally
    factory     building both halves from ExecutorConfig.kv_connector_config
    keys        store namespace and block keys chained over the prefix
    store       the persistent store's folder: probes, recency, LRU eviction under a bound
    persistent  the persistent store connector (on the file agent, agents/file_agent.py)
    trtllm      the same connector for TensorRT-LLM's LLM(kv_connector_config=...) (untested there)
    trtllm_api  the other way round: connectors written for TensorRT-LLM (built from llm_args) run here
    trtllm_example  TensorRT-LLM's example PersistentKvCacheConnector, rewritten without pickle
"""

from .base import (
    ConnectorContext,
    ConnectorMetadata,
    ConnectorRequest,
    KvConnectorConfig,
    KvConnectorScheduler,
    KvConnectorWorker,
    RequestData,
    SchedulerOutput,
)

__all__ = ["ConnectorContext", "ConnectorMetadata", "ConnectorRequest", "KvConnectorConfig",
           "KvConnectorScheduler", "KvConnectorWorker", "RequestData", "SchedulerOutput"]
