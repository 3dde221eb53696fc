"""Resolve every transfer agent a serving config names, before anything starts (`kvbridge serve --check`
and `kvbridge serve`): a registered name, an installed entry point, or `module:Class` importable from the
working directory. Never constructs an agent and never opens a socket; a name that resolves to nothing is a
ServeConfigError naming the config key and how to register one.
"""

from __future__ import annotations

from ..agents.registry import get_agent_class
from ..errors import AgentError, ServeConfigError
from .config import ServeConfig

__all__ = ["check_agents"]

AUTO = "auto"  # expanded by the transceiver to built-ins (cuda_ipc, nixl)


def check_agents(cfg: ServeConfig) -> None:
    """ServeConfigError for the first agent named in `cfg` that cannot be resolved."""
    for s in cfg.servers():
        named = s.transceiver.get("agents", s.transceiver.get("agent", [AUTO]))
        named = [named] if isinstance(named, str) else list(named)
        key = "context_servers" if s.role == "context" else "generation_servers"
        for name in named:
            if name == AUTO:
                continue
            try:
                get_agent_class(name)
            except AgentError as e:
                raise ServeConfigError(f"{key}.transceiver.agent ({s.name}): {e}") from None
