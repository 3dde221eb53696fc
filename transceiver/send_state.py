"""The context side's per-request state: a published request (Entry), what is remembered once it finished
(Tomb), and the result handed to the executor (SendResult).

Pure state, changed only by the Sender's I/O thread (sender.py, and its off-thread jobs' callbacks on that
thread); nothing here touches a socket or the pool.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Entry", "SendResult", "Tomb"]


@dataclass
class SendResult:
    """A request that is finished on this context rank; its blocks may be freed once all ranks agree."""

    ctx_request_id: int
    status: str  # "complete" | "failed" | "expired" | "cancelled"
    detail: str = ""
    readers: int = 0


@dataclass
class Entry:
    """One published request on this context rank: its blocks, secret, readers and their progress."""

    rid: int
    blocks: np.ndarray
    num_tokens: int
    layers_ready: int
    deadline: float
    secret: bytes = field(default=b"", repr=False)
    instance: str | None = None
    expected: frozenset[int] = frozenset()
    fetched: dict[int, bytes] = field(default_factory=dict)  # gen rank -> ROUTER identity
    done: dict[int, bool] = field(default_factory=dict)  # gen rank -> ok
    cancel_requested: bool = False
    published_at: float = field(default_factory=time.monotonic)
    slots: dict[int, int] = field(default_factory=dict)  # gen rank -> staging slot address (staged path)
    packing: set[int] = field(default_factory=set)  # gen ranks whose slot is being packed right now
    read_from: dict[int, int] = field(default_factory=dict)  # gen rank -> first token it reads (prefix reuse)

    @property
    def active_readers(self) -> int:
        return len(set(self.fetched) - set(self.done))


@dataclass(frozen=True)
class Tomb:
    """What is remembered of a finished request: told only to those who show its secret (or read it)."""

    status: str
    secret: bytes = field(repr=False)
    readers: frozenset[bytes]
