"""kvbridge inside vLLM: `KVBridgeConnector`, a vLLM v1 KV connector (`connector.py`), and its parts.

Load it the way vLLM loads an out-of-tree connector:

    --kv-transfer-config '{"kv_connector": "KVBridgeConnector",
                           "kv_connector_module_path": "kvbridge.integrations.vllm.connector",
                           "kv_role": "kv_both", "kv_connector_extra_config": {"transceiver": {...}}}'

Modules: `params.py` (the kv_transfer_params a prefill answers and a decode takes), `layout.py` (vLLM's KV
tensors as a kvbridge KVLayout, positional digests), `scheduler.py` (the scheduler-side state), `worker.py`
(the worker-side transceiver), `connector.py` (the vLLM facade; the only module that imports vllm).
Importing this package imports no vllm.
"""
