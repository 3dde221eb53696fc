"""TensorRT-LLM's `cache_transceiver_config` names, as `kvbridge.trtllm` imports them.

Owns nothing: the translation lives in config.py beside TransceiverConfig (each converts into the other, so
one module holds both and no import circle is needed). Must never grow code of its own.
"""

from .config import ENV_SWITCHES, UPSTREAM_KEYS, Backend, CacheTransceiverConfig, is_upstream

__all__ = ["Backend", "CacheTransceiverConfig", "ENV_SWITCHES", "UPSTREAM_KEYS", "is_upstream"]
