"""Byte movers: the TransferAgent contract, its registry, and the agents kvbridge ships.

Knows nothing of KV caches. Everything an agent author needs is importable from here (see `base.py` for the
contract and its thread rules, `registry.py` for plugging in your own, `conformance` for the suite that
`kvbridge check-agent MODULE:CLASS` runs against a class):

    from kvbridge.agents import (TransferAgent, TransferHandle, FutureTransfer, DescriptorList, MemoryKind,
                                 MemoryRegion, RegionTable, XferState, seal, open_envelope, field, PeerError,
                                 register_agent)

Importing this package imports no transport (NIXL, CUDA, sockets are loaded by the agent that uses them).
"""

from ..errors import (AgentError, ConnectionClosed, ConnectionDeadline, ConnectionFailed, PeerError,
                      ProtocolError, RegistrationError, TransferFailed, TransferTimeout)
from .base import (
    DescriptorGrid,
    DescriptorList,
    MemoryKind,
    MemoryRegion,
    Registration,
    RegionTable,
    TransferAgent,
    TransferHandle,
    XferState,
)
from .conn_agent import ConnectionAgent, ConnectionTransfer
from .connection import Connection, Listener
from .envelope import METADATA_VERSION, field, open_envelope, seal
from .handles import FutureTransfer
from .registry import available_agents, create_agent, get_agent_class, register_agent

__all__ = [
    # the contract and its handles
    "TransferAgent", "TransferHandle", "FutureTransfer", "Registration", "XferState",
    # descriptors and memory
    "DescriptorList", "DescriptorGrid", "MemoryKind", "MemoryRegion", "RegionTable",
    # metadata envelope helpers (what `_metadata`/`_connect` use)
    "seal", "open_envelope", "field", "METADATA_VERSION",
    # two-sided transports: a Connection class becomes an agent through ConnectionAgent
    "ConnectionAgent", "ConnectionTransfer", "Connection", "Listener",
    # errors an agent raises
    "AgentError", "RegistrationError", "PeerError", "TransferFailed", "TransferTimeout", "ProtocolError",
    "ConnectionFailed", "ConnectionClosed", "ConnectionDeadline",
    # registry
    "available_agents", "create_agent", "get_agent_class", "register_agent",
]
