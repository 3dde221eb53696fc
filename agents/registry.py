"""Agents by name: `register_agent("mine", MyAgent)`, or the `kvbridge.agents` entry-point group.

    [project.entry-points."kvbridge.agents"]
    mine = "my_package.my_module:MyAgent"

A "module:Class" spec works wherever a name does (the module from sys.path, else the working directory).
`create_agent("mine", name)` builds one; `available_agents()` lists every name known (built-ins, entry
points, explicit registrations). Entry points are loaded lazily, on first lookup.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
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


def how_to_register(name: str) -> str:
    """What a user does so that `name` resolves (for error messages)."""
    return (f"register it with an entry point in your package's pyproject.toml ([project.entry-points."
            f"\"kvbridge.agents\"] {name} = \"my_package.my_module:MyAgent\", then pip install the package), "
            f"or name the class as MODULE:CLASS importable from the working directory; "
            f"register_agent({name!r}, MyAgent) reaches only the calling process, not spawned workers")


def _import_spec(spec: str) -> type[TransferAgent]:
    """A 'module:Class' spec; the module on sys.path, else in the working directory."""
    mod_name, _, attr = spec.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        if e.name != mod_name.partition(".")[0] or os.getcwd() in sys.path:
            raise AgentError(f"agent {spec!r} could not be loaded: {e}") from e
        sys.path.append(os.getcwd())
        try:
            mod = importlib.import_module(mod_name)
        except ImportError as e2:
            raise AgentError(f"agent {spec!r} could not be loaded (looked on sys.path and in "
                             f"{os.getcwd()}): {e2}") from e2
    except ImportError as e:
        raise AgentError(f"agent {spec!r} could not be loaded: {e}") from e
    cls = getattr(mod, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, TransferAgent)):
        raise AgentError(f"agent {spec!r}: {attr!r} in {mod.__name__} is not a TransferAgent subclass")
    return cls


def get_agent_class(name: str) -> type[TransferAgent]:
    """The class registered as `name` (or named by a 'module:Class' spec); AgentError saying what is known
    and how to register one if there is none."""
    _load_entry_points()
    with _lock:
        target = _registered.get(name, _BUILTIN.get(name))
    if target is None and ":" in name:
        return _import_spec(name)
    if target is None:
        raise AgentError(f"no transfer agent named {name!r} is registered (known: "
                         f"{', '.join(available_agents())}); {how_to_register(name)}")
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
