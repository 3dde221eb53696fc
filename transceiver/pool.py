"""A rank's KV pool as the transceiver holds it: the buffers, their registrations, the agents that serve them.

Owns the agents of one rank (created from the config's preference list) and the registration of the pool
with each of them. Never frees the pool's memory: the executor owns it and must outlive this object.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Sequence

from ..agents import MemoryKind, MemoryRegion, Registration, TransferAgent, create_agent
from ..errors import AgentError, KvBridgeError
from ..formatter.layout import KVLayout
from ..formatter.planner import RankPool
from .config import TransceiverConfig

log = logging.getLogger(__name__)

__all__ = ["LocalPool", "resolve_agent_kinds"]


def resolve_agent_kinds(prefs: Sequence[str], kind: MemoryKind) -> list[str]:
    """Expand "auto": GPU pools prefer the intra-node kernel agent, then NIXL; host pools use NIXL."""
    out: list[str] = []
    for p in prefs:
        expanded = (["cuda_ipc", "nixl"] if kind is MemoryKind.VRAM else ["nixl"]) if p == "auto" else [p]
        out += [k for k in expanded if k not in out]
    return out


class LocalPool:
    """One rank's pool(s), registered with every agent this rank offers.

    Args:
        layout: the executor's KV layout.
        rank: this rank's global rank in its executor.
        buffers: the pool tensor/array (block_major), or one per local layer (layer_pools); contiguous.
        num_blocks: blocks in the pool.
        config: agent preferences and per-agent options.
        name: agent name prefix (unique per process by default).
    """

    def __init__(self, layout: KVLayout, rank: int, buffers, num_blocks: int, config: TransceiverConfig,
                 name: str | None = None) -> None:
        bufs = list(buffers) if isinstance(buffers, (list, tuple)) else [buffers]
        self.buffers = bufs
        self.layout, self.rank, self.num_blocks = layout, rank, num_blocks
        self.regions = [MemoryRegion.of(b) for b in bufs]
        self.kind = self.regions[0].kind
        want = sum(r.length for r in self.regions)
        need = layout.block_bytes(rank) * num_blocks
        if want != need:
            raise KvBridgeError(f"pool buffers hold {want} bytes; layout {layout.describe()} rank {rank} with "
                                f"{num_blocks} blocks needs {need}")
        self.device = self.regions[0].device
        self.rank_pool = RankPool.of(layout, rank, [r.addr for r in self.regions], num_blocks, self.kind,
                                     self.device)
        self.arena = None
        if config.staging_arena_bytes:
            from .staging import StagingArena

            self.arena = StagingArena(self.kind, self.device, config.staging_arena_bytes, config.staging_memory)
        base = name or f"kvb-{os.getpid()}-{uuid.uuid4().hex[:8]}-r{rank}"
        self.agents: dict[str, TransferAgent] = {}
        self._regs: list[Registration] = []
        why: list[str] = []
        for kind in resolve_agent_kinds(config.agents, self.kind):
            agent, regs = None, []
            try:
                agent = create_agent(kind, f"{base}-{kind}", **config.agent_options(kind, rank))
                for r in self.regions + ([self.arena.region] if self.arena is not None else []):
                    regs.append(agent.register_memory(r))
            except (AgentError, KvBridgeError, OSError) as e:
                log.info("agent %s not available for rank %d's %s pool: %s", kind, rank, self.kind.value, e)
                why.append(f"{kind}: {e}")
                for reg in regs:  # e.g. cuda_ipc took the VRAM pool but cannot take a host arena
                    reg.release()
                if agent is not None:
                    agent.close()
                continue
            self.agents[kind] = agent
            self._regs += regs
        if not self.agents:
            host = " with a host staging arena (transceiver.staging_memory: host)" if self.arena is not None and \
                self.arena.kind is not self.kind else ""
            raise AgentError(f"no transfer agent of {list(config.agents)} could serve a "
                             f"{self.kind.value} pool{host} ({'; '.join(why)})")

    @property
    def bases(self) -> list[int]:
        return [r.addr for r in self.regions]

    def close(self) -> None:
        for r in self._regs:
            r.release()
        self._regs.clear()
        for a in self.agents.values():
            a.close()
        self.agents.clear()
