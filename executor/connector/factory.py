"""Building a connector's halves from the executor config: validate the spec, import the classes, the context.

The spec travels to every rank inside the msgpack executor config as {"module", "scheduler", "worker",
"args"} (KvConnectorConfig.to_wire). Both halves get a ConnectorContext whose namespace is derived the same
way on every rank from the model spec, the model config and the layout.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from ...errors import ExecutorError
from ...formatter.layout import KVLayout
from .base import ConnectorContext, KvConnectorConfig, KvConnectorScheduler, KvConnectorWorker
from .keys import namespace_for

__all__ = ["check_spec", "connector_wire", "load_class", "make_context"]


def connector_wire(cfg: KvConnectorConfig | dict | None) -> dict | None:
    """ExecutorConfig.kv_connector_config -> the spec put in the executor config blob (validated)."""
    if cfg is None:
        return None
    if isinstance(cfg, KvConnectorConfig):
        return check_spec(cfg.to_wire())
    if isinstance(cfg, dict):
        if "connector_module" in cfg:
            return check_spec(KvConnectorConfig(**cfg).to_wire())
        return check_spec(cfg)
    raise ExecutorError(f"kv_connector_config must be a KvConnectorConfig or a dict, got {type(cfg).__name__}")


def check_spec(spec: Any) -> dict:
    if not isinstance(spec, dict):
        raise ExecutorError("kv_connector: expected a map with module, scheduler, worker, args")
    for k in ("module", "scheduler", "worker"):
        if not isinstance(spec.get(k), str) or not spec[k]:
            raise ExecutorError(f"kv_connector: {k!r} must be a non-empty string, got {spec.get(k)!r:.80}")
    if not isinstance(spec.get("args", {}), dict):
        raise ExecutorError("kv_connector: 'args' must be a map")
    return {"module": spec["module"], "scheduler": spec["scheduler"], "worker": spec["worker"],
            "args": dict(spec.get("args") or {})}


def load_class(spec: dict, role: str) -> type:
    """The scheduler ("scheduler") or worker ("worker") class the spec names, checked against our bases."""
    base = KvConnectorScheduler if role == "scheduler" else KvConnectorWorker
    try:
        cls = getattr(importlib.import_module(spec["module"]), spec[role])
    except (ImportError, AttributeError) as e:
        raise ExecutorError(f"kv_connector {role} {spec['module']}:{spec[role]} cannot be loaded: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ExecutorError(f"kv_connector {role} {spec['module']}:{spec[role]} is not a {base.__name__} subclass")
    return cls


def make_context(spec: dict, cfg: dict, layout: KVLayout, rank: int, device: torch.device,
                 model_config: dict) -> ConnectorContext:
    """The context of one half (rank 0 for the scheduler)."""
    args = dict(spec.get("args") or {})
    ns = namespace_for(layout, str(cfg["model"]), model_config, str(args.get("namespace_extra", "")))
    return ConnectorContext(rank, layout.world_size, layout.shape.tokens_per_block, ns, str(cfg["model"]), device,
                            int(cfg["num_blocks"]), args, layout)
