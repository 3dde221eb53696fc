"""kvbridge: the KV-cache transfer layer for disaggregated LLM serving.

Packages, lowest first (imports only go up this list, never down):
    agents       byte movers (TransferAgent and its implementations), knowing nothing of KV
    formatter    KV geometry: layouts, the ctx<->gen rank mapping, the fragment planner
    kvcache      the paged KV pool of one rank and the chained block keys (beside transceiver)
    transceiver  the control plane: wire messages over ZeroMQ, sender, receiver, CacheTransceiver
    executor     a reference engine (Llama-family model on a kvcache pool) to test on real KV; beside it the
                 engine adapters (integrations/vllm, trtllm), which never import it
    serving      worker processes, router, launcher and the `kvbridge` CLI
"""

__version__ = "0.1.0"
