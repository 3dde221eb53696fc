"""Resolve every transfer agent a serving config names, before anything starts (`kvbridge serve --check`
and `kvbridge serve`): a registered name, an installed entry point, or `module:Class` importable from the
working directory. Never constructs an agent and never opens a socket; a name that resolves to nothing is a
ServeConfigError naming the config key and how to register one.
"""

from __future__ import annotations

import importlib.util

from ..agents.registry import get_agent_class
from ..errors import AgentError, ServeConfigError
from .config import ServeConfig

__all__ = ["check_agents"]

AUTO = "auto"  # expanded by the transceiver to built-ins (cuda_ipc, nixl)


def nixl_installed() -> bool:
    """Whether the nixl agent's package can be found (not imported: that loads the native library)."""
    for m in ("nixl_cu13", "nixl"):
        try:
            if importlib.util.find_spec(m) is not None:
                return True
        except (ImportError, ValueError):  # a broken or blocked install counts as absent
            continue
    return False


def check_agents(cfg: ServeConfig) -> None:
    """ServeConfigError for the first agent named in `cfg` that cannot be resolved, or a host-memory server
    whose only agents need `nixl-cu13` when it is not installed."""
    for s in cfg.servers():
        named = s.transceiver.get("agents", s.transceiver.get("agent", [AUTO]))
        named = [named] if isinstance(named, str) else list(named)
        key = "context_servers" if s.role == "context" else "generation_servers"
        on_host = str(s.executor.get("device", "cpu")) == "cpu"
        if on_host and set(named) <= {AUTO, "nixl"} and not nixl_installed():
            raise ServeConfigError(f"{key}.transceiver.agent ({s.name}): {' / '.join(named)} means the nixl "
                                   f"agent for host memory, and its package is not installed: pip install "
                                   f"'kvbridge[nixl]' (or nixl-cu13), or name another agent, e.g. "
                                   f"`transceiver: {{agent: tcp}}`")
        for name in named:
            if name == AUTO:
                continue
            try:
                get_agent_class(name)
            except AgentError as e:
                raise ServeConfigError(f"{key}.transceiver.agent ({s.name}): {e}") from None
