"""kvbridge inside vLLM.

Modules:
    tiny_model  a small random Llama (config + seeded safetensors) and a byte-level BPE tokenizer, written
                into a cached folder vLLM can serve (no download)
    launch      start / wait for / pin / stop one vLLM OpenAI server process (imports no vllm)

Importing this package imports no vllm; only the connector module does.
"""
