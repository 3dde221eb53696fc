"""What the scheduler-side connector tells its workers each step, and what workers report back.

Scheduler -> every worker (inside vLLM's connector metadata, vLLM's own process boundary): `StepWork`.
Worker -> scheduler (vLLM's KVConnectorWorkerMetadata): `PullStats` per finished pull. Plain frozen values;
request ids are vLLM's strings, handles kvbridge's 63-bit wire ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Publish", "Pull", "Refuse", "StepWork", "PullStats", "IDLE_WAIT_MS", "idle_wait_s"]


@dataclass(frozen=True)
class Publish:
    """Prefill side: pin `block_ids` (the first `num_tokens` tokens of req_id) under handle + secret."""

    req_id: str
    handle: int
    secret: bytes = field(repr=False)
    block_ids: tuple[int, ...]
    num_tokens: int
    streamed: bool = False  # early decode: published before the forward; layers marked as they are written


@dataclass(frozen=True)
class Pull:
    """Decode side: read the remote prefill `disagg` (DisaggParams dict) into block_ids, tokens
    [from_token, num_tokens) (tokens before from_token are already in vLLM's local prefix cache)."""

    req_id: str
    disagg: dict = field(repr=False)
    block_ids: tuple[int, ...]
    num_tokens: int
    from_token: int = 0
    packing: str = ""  # the prefill kernel's packing digest (params.RemotePrefill.packing)


@dataclass(frozen=True)
class Refuse:
    """Decode side: fail req_id's load at once (nothing pulled): its kv_transfer_params were refused."""

    req_id: str
    reason: str


@dataclass
class StepWork:
    publishes: list[Publish] = field(default_factory=list)
    pulls: list[Pull] = field(default_factory=list)
    refusals: list[Refuse] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)  # decode requests aborted while their pull runs
    finished: list[str] = field(default_factory=list)  # streamed prefill requests vLLM has finished
    send_cancels: list[str] = field(default_factory=list)  # streamed prefill requests aborted: unpublish
    withdraws: list[tuple[dict, int]] = field(default_factory=list)  # (disagg params, tokens) of decode requests
    #                                  finished before their pull began: the prefill frees their KV now
    idle: bool = False  # vLLM runs no forward this step: a worker whose pulls are in flight may wait for them

    def __bool__(self) -> bool:
        return bool(self.publishes or self.pulls or self.refusals or self.cancels or self.finished or
                    self.send_cancels or self.withdraws)


# A step with no forward (the engine only waits, e.g. for remote KV) blocks a worker up to this long for one of
# its pulls to finish instead of spinning into the next empty step (`kv_connector_extra_config.idle_wait_ms`);
# a request arriving meanwhile waits at most this long for the engine.
IDLE_WAIT_MS = 5.0


def idle_wait_s(ms: Any) -> float:
    """`idle_wait_ms` checked and in seconds; ValueError naming the key for anything but 0..1000 ms."""
    if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not 0 <= ms <= 1000:
        raise ValueError(f"kv_connector_extra_config.idle_wait_ms must be a number of milliseconds in [0, 1000] "
                         f"(0: never wait), got {ms!r}")
    return float(ms) / 1e3


@dataclass(frozen=True)
class PullStats:
    """One worker's outcome of one pull (the scheduler sums the workers' bytes, keeps the slowest time)."""

    nbytes: int = 0
    ms: float = 0.0  # the whole pull: Fetch, reads, confirmation (and a repack between block sizes)
    error: str = ""
    read_ms: float = 0.0  # the reads alone (first READ posted -> last done), as vLLM's NIXL metric counts
    first_read_unix_ms: float = 0.0  # wall clock of the first READ posted (0: none), for overlap evidence
    transport_ms: float = 0.0  # the reads on NIXL's own clock (its telemetry, as vLLM times NixlConnector's)

    def merge(self, other: "PullStats") -> "PullStats":
        firsts = [t for t in (self.first_read_unix_ms, other.first_read_unix_ms) if t]
        return PullStats(self.nbytes + other.nbytes, max(self.ms, other.ms), self.error or other.error,
                         max(self.read_ms, other.read_ms), min(firsts) if firsts else 0.0,
                         max(self.transport_ms, other.transport_ms))
