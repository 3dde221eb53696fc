"""kvbridge inside vLLM: `KVBridgeConnector`, a vLLM v1 KV connector, and what runs it.

Load it the way vLLM loads an out-of-tree connector:

    --kv-transfer-config '{"kv_connector": "KVBridgeConnector",
                           "kv_connector_module_path": "kvbridge.integrations.vllm.connector",
                           "kv_role": "kv_both", "kv_connector_extra_config": {"transceiver": {...}}}'

Modules:
    connector   the vLLM facade (KVConnectorBase_V1); the only module that imports vllm
    scheduler   the scheduler-side state: who publishes, who pulls, what the client is told
    worker      the worker-side transceiver over vLLM's cache tensors
    work        the scheduler -> worker step work and worker -> scheduler stats
    params      the kv_transfer_params a prefill answers and a decode takes
    layout      vLLM's KV tensors as a kvbridge KVLayout; positional digests
    tiny_model  a small random Llama (config + seeded safetensors) and a byte-level BPE tokenizer, written
                into a cached folder vLLM can serve (no download)
    launch      start / wait for / pin / stop one vLLM OpenAI server process (imports no vllm)

Importing this package imports no vllm; only the connector module does.
"""
