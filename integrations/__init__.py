"""kvbridge.integrations: adapters that put kvbridge inside other engines (vLLM: `integrations/vllm/`).

Each adapter sits over transceiver/, formatter/ and agents/ only and imports its engine in its own modules;
nothing below (agents .. serving) imports an adapter, except through a leaf that imports no engine
(`integrations/vllm/launch.py` builds a vLLM server's command line; serving/ starts servers with it).
"""
