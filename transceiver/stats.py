"""`TransferStats`: what one generation rank's pull of a request moved and how long each phase took.

Made on the generation rank from its ReceiveResult (`of`), carried to the executor's leader in the rank hook's
report (executor/hooks.py, "stats"), and from there in the request's Completion (`Completion.transfer`);
serving shows it in a response's `kvbridge.transfer` object (`as_json`) and observes its total time.

Owns the stats' form and its strict wire codec (a versioned msgpack-able map, decoded field by field; bad
input raises ProtocolError naming the field). Never touches a transfer, never holds a reference to one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping

from ..errors import ProtocolError

if TYPE_CHECKING:  # only the annotation: ReceiveResult's module is being restructured
    from .pull import ReceiveResult

__all__ = ["TransferStats", "of", "STATS_VERSION"]

STATS_VERSION = 1  # bump when a field changes meaning or type (new fields come with defaults)
MAX_AGENTS = 64
MAX_TIMINGS = 64


@dataclass(frozen=True, slots=True)
class TransferStats:
    """One finished pull on one generation rank.

    Attributes:
        nbytes: KV bytes read from every context rank.
        fragments: descriptors handed to the transfer agents.
        agents: the agent kinds used (one per context rank read from, in order).
        timings_ms: phase -> milliseconds ("total" is the whole pull).
    """

    nbytes: int = 0
    fragments: int = 0
    agents: tuple[str, ...] = ()
    timings_ms: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))

    def as_json(self) -> dict[str, Any]:
        """The form a response shows (`kvbridge.transfer`): bytes, fragments, agents, ms (3 decimals)."""
        return {"bytes": self.nbytes, "fragments": self.fragments, "agents": list(self.agents),
                "ms": {k: round(v, 3) for k, v in self.timings_ms.items()}}

    def to_wire(self) -> dict[str, Any]:
        return {"v": STATS_VERSION, "nbytes": self.nbytes, "fragments": self.fragments,
                "agents": list(self.agents), "ms": dict(self.timings_ms)}

    @classmethod
    def from_wire(cls, d: Any) -> "TransferStats":
        """Decode strictly; ProtocolError naming the bad field (bool is not an int, bounded sizes)."""
        if not isinstance(d, dict):
            raise ProtocolError(f"transfer stats: expected a map, got {type(d).__name__}")
        v = d.get("v")
        if type(v) is not int or v != STATS_VERSION:
            raise ProtocolError(f"transfer stats: version {v!r}, expected {STATS_VERSION}")
        nbytes, frags = d.get("nbytes"), d.get("fragments")
        for name, val in (("nbytes", nbytes), ("fragments", frags)):
            if type(val) is not int or val < 0:
                raise ProtocolError(f"transfer stats: field {name!r} is {val!r:.40}, expected an int >= 0")
        agents = d.get("agents")
        if (not isinstance(agents, list) or len(agents) > MAX_AGENTS
                or not all(isinstance(a, str) for a in agents)):
            raise ProtocolError(f"transfer stats: field 'agents' is {agents!r:.80}, expected at most "
                                f"{MAX_AGENTS} names")
        ms = d.get("ms")
        if (not isinstance(ms, dict) or len(ms) > MAX_TIMINGS
                or not all(type(t) in (int, float) for t in ms.values())):
            raise ProtocolError(f"transfer stats: field 'ms' is {ms!r:.80}, expected phase -> milliseconds")
        return cls(nbytes, frags, tuple(agents), MappingProxyType({k: float(t) for k, t in ms.items()}))


def of(result: "ReceiveResult") -> TransferStats:
    """The stats of a finished (successful) pull."""
    return TransferStats(int(result.nbytes), int(result.fragments), tuple(str(a) for a in result.agents),
                         MappingProxyType({str(k): float(v) for k, v in result.timings_ms.items()}))
