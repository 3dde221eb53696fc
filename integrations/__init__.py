"""Engine adapters that sit on kvbridge's transceiver, formatter and agents (never on the reference executor).

`integrations.vllm`: a KV connector that real vLLM instances load for prefill/decode disaggregation.
"""
