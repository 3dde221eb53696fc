"""Which hops the router runs for a config's engine: kvbridge's own workers (router.py itself) or another
engine's OpenAI servers (`engine: vllm`: vllm_backend.py). A table, so router.py names no engine's module and
imports one only when a config uses it."""

from __future__ import annotations

import importlib

__all__ = ["ROUTER_BACKENDS", "engine_backend"]

ROUTER_BACKENDS = {"vllm": "kvbridge.serving.vllm_backend:VllmBackend"}  # engine: "module:class"


def engine_backend(router):
    """The backend running the hops of `router`'s config (built with the Router), or None for kvbridge's."""
    target = ROUTER_BACKENDS.get(router.cfg.engine)
    if target is None:
        return None
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)(router)
