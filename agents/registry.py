"""Agents by name: `register_agent("mine", MyAgent)`, or the `kvbridge.agents` entry-point group.

    [project.entry-points."kvbridge.agents"]
    mine = "my_package.my_module:MyAgent"

`create_agent("mine", name)` builds one; `available_agents()` lists every name known (built-ins, entry
points, explicit registrations). Entry points are loaded lazily, on first lookup.
"""

from __future__ import annotations

import importlib
import logging
import threading
from importlib import metadata as importlib_metadata

from ..errors import AgentError
from .base import TransferAgent

log = logging.getLogger(__name__)

# Built-ins as "module:Class" so that importing the registry imports no transport.
_BUILTIN: dict[str, str] = {
    "nixl": "kvbridge.agents.nixl_agent:NixlAgent",
    "tcp": "kvbridge.agents.tcp:TcpAgent",
    "gloo": "kvbridge.agents.dist_connection:GlooAgent",
    "nccl": "kvbridge.agents.dist_connection:NcclAgent",
    "cuda_ipc": "kvbridge.agents.cuda_ipc:CudaIpcAgent",
    "file": "kvbridge.agents.file_agent:FileAgent",
}
_registered: dict[str, type[TransferAgent] | str] = {}
_lock = threading.Lock()
_entry_points_loaded = False


def register_agent(name: str, cls: type[TransferAgent] | str, *, replace: bool = False) -> None:
    """Make `cls` (a TransferAgent subclass, or "module:Class") available as `name`."""
    if not isinstance(cls, str) and not (isinstance(cls, type) and issubclass(cls, TransferAgent)):
        raise AgentError(f"register_agent({name!r}): {cls!r} is not a TransferAgent subclass")
    with _lock:
        if name in _registered and not replace and _registered[name] is not cls:
            raise AgentError(f"an agent named {name!r} is already registered; pass replace=True to override")
        _registered[name] = cls


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    try:
        eps = importlib_metadata.entry_points(group="kvbridge.agents")
    except Exception as e:  # noqa: BLE001
        log.warning("could not read kvbridge.agents entry points: %s", e)
        return
    for ep in eps:
        with _lock:
            _registered.setdefault(ep.name, ep.value)


def available_agents() -> list[str]:
    """Every agent name that `get_agent_class` can resolve (without importing them)."""
    _load_entry_points()
    with _lock:
        return sorted(set(_BUILTIN) | set(_registered))


def get_agent_class(name: str) -> type[TransferAgent]:
    """The class registered as `name`; AgentError naming the known ones if there is none."""
    _load_entry_points()
    with _lock:
        target = _registered.get(name, _BUILTIN.get(name))
    if target is None:
        raise AgentError(f"no transfer agent named {name!r}; known: {', '.join(available_agents())}")
    if isinstance(target, str):
        mod_name, _, attr = target.partition(":")
        try:
            cls = getattr(importlib.import_module(mod_name), attr)
        except (ImportError, AttributeError) as e:
            raise AgentError(f"agent {name!r} ({target}) could not be loaded: {e}") from e
        if not (isinstance(cls, type) and issubclass(cls, TransferAgent)):
            raise AgentError(f"agent {name!r} ({target}) is not a TransferAgent subclass")
        with _lock:
            _registered[name] = cls
        return cls
    return target


def create_agent(kind: str, name: str, **options) -> TransferAgent:
    """Build the agent registered as `kind`, called `name` (unique among its peers)."""
    return get_agent_class(kind)(name, **options)
