"""Byte movers: the TransferAgent contract, its registry, and the agents kvbridge ships.

Knows nothing of KV caches. See `base.py` for the contract and `registry.py` for plugging in your own.
"""

from .base import (
    DescriptorList,
    MemoryKind,
    MemoryRegion,
    Registration,
    RegionTable,
    TransferAgent,
    TransferHandle,
    XferState,
)
from .registry import available_agents, create_agent, get_agent_class, register_agent

__all__ = [
    "DescriptorList", "MemoryKind", "MemoryRegion", "Registration", "RegionTable", "TransferAgent",
    "TransferHandle", "XferState", "available_agents", "create_agent", "get_agent_class", "register_agent",
]
