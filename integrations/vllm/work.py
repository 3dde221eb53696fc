"""What the scheduler-side connector tells its workers each step, and what workers report back.

Scheduler -> every worker (inside vLLM's connector metadata, vLLM's own process boundary): `StepWork`.
Worker -> scheduler (vLLM's KVConnectorWorkerMetadata): `PullStats` per finished pull. Plain frozen values;
request ids are vLLM's strings, handles kvbridge's 63-bit wire ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Publish", "Pull", "Refuse", "StepWork", "PullStats"]


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

    def __bool__(self) -> bool:
        return bool(self.publishes or self.pulls or self.refusals or self.cancels or self.finished or
                    self.send_cancels)


@dataclass(frozen=True)
class PullStats:
    """One worker's outcome of one pull (the scheduler sums the workers' bytes, keeps the slowest time)."""

    nbytes: int = 0
    ms: float = 0.0  # the whole pull: Fetch, reads, confirmation (and a repack between block sizes)
    error: str = ""
    read_ms: float = 0.0  # the reads alone (first READ posted -> last done), as vLLM's NIXL metric counts
    first_read_unix_ms: float = 0.0  # wall clock of the first READ posted (0: none), for overlap evidence

    def merge(self, other: "PullStats") -> "PullStats":
        firsts = [t for t in (self.first_read_unix_ms, other.first_read_unix_ms) if t]
        return PullStats(self.nbytes + other.nbytes, max(self.ms, other.ms), self.error or other.error,
                         max(self.read_ms, other.read_ms), min(firsts) if firsts else 0.0)
