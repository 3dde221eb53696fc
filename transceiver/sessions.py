"""The context rank's table of generation-rank sessions: bounded in number and in lifetime.

A session is what a Hello leaves behind on a context rank: the peer's instance, rank and layout, keyed by its
ROUTER identity. The table holds at most `max_sessions`; a session is dropped when its peer is known to be gone
(a send to it failed) or has been silent for `peer_timeout_s` while no read of it is in flight here. Owned by
the sender's I/O thread (no locking); never sends anything itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from ..formatter.layout import KVLayout

__all__ = ["Session", "SessionTable"]


@dataclass
class Session:
    instance: str
    gen_rank: int
    layout: KVLayout
    last_seen: float = field(default_factory=time.monotonic)


class SessionTable:
    """Sessions by ROUTER identity.

    Args:
        max_sessions: most sessions at once (`add` refuses beyond it).
        peer_timeout_s: silence after which an idle peer's session is dropped.
    """

    def __init__(self, max_sessions: int, peer_timeout_s: float) -> None:
        self.max_sessions, self.peer_timeout_s = max_sessions, peer_timeout_s
        self._by_ident: dict[bytes, Session] = {}
        self._next_sweep = 0.0

    def __len__(self) -> int:
        return len(self._by_ident)

    def get(self, ident: bytes) -> Session | None:
        return self._by_ident.get(ident)

    def heard(self, ident: bytes, now: float) -> None:
        """A frame arrived from `ident`: its session (if any) is alive."""
        s = self._by_ident.get(ident)
        if s is not None:
            s.last_seen = now

    def add(self, ident: bytes, session: Session, busy: Callable[[], set[bytes]] = set) -> bool:
        """Start (or renew) `ident`'s session; False when the table is full even after dropping silent ones
        (`busy()`: identities whose sessions must stay, asked only when the table is full)."""
        if ident not in self._by_ident and len(self._by_ident) >= self.max_sessions:
            self.sweep(session.last_seen, busy())
            if len(self._by_ident) >= self.max_sessions:
                return False
        self._by_ident[ident] = session
        return True

    def drop(self, ident: bytes) -> None:
        self._by_ident.pop(ident, None)

    def sweep_due(self, now: float) -> bool:
        return now >= self._next_sweep

    def sweep(self, now: float, busy: set[bytes]) -> int:
        """Drop the sessions silent for peer_timeout_s whose identity is not in `busy`; returns how many."""
        self._next_sweep = now + min(1.0, self.peer_timeout_s / 4)
        limit = now - self.peer_timeout_s
        gone = [i for i, s in self._by_ident.items() if s.last_seen < limit and i not in busy]
        for ident in gone:
            del self._by_ident[ident]
        return len(gone)
