"""The generation worker's table of prefetched requests (overlap: serving/overlap_worker.py): each waits,
under its handle and secret, for the router's claim and the context hop's first token. Event loop only.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

__all__ = ["Prefetched", "Prefetches"]


@dataclass
class Prefetched:
    """A prefetched generation-only request: executor id, secret, what a claim must match, deadline."""

    rid: int
    secret: bytes
    key: tuple  # (prompt, max_tokens, sampling): a claim must match
    deadline: float
    joined: int | None = None  # the first token, once POST /internal/join gave it


class Prefetches:
    """handle -> a prefetched generation-only request waiting for its first token. Event loop only."""

    def __init__(self) -> None:
        self._by_handle: dict[int, Prefetched] = {}

    def __len__(self) -> int:
        return len(self._by_handle)

    def add(self, handle: int, p: Prefetched) -> None:
        self._by_handle[handle] = p

    def get(self, handle: int, secret: bytes) -> Prefetched | None:
        """The prefetch of `handle` if `secret` is its secret (constant time); else None."""
        p = self._by_handle.get(handle)
        return p if p is not None and hmac.compare_digest(p.secret, secret) else None

    def take(self, handle: int, secret: bytes) -> Prefetched | None:
        """`get`, removed from the table."""
        p = self.get(handle, secret)
        return None if p is None else self._by_handle.pop(handle)

    def expired(self, now: float) -> list[int]:
        """Executor ids of the prefetches whose deadline passed, removed."""
        gone = [h for h, p in self._by_handle.items() if p.deadline <= now]
        return [self._by_handle.pop(h).rid for h in gone]
