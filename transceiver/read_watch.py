"""Tells a context rank's transfer agents when peers may be reading its memory, so a transport that must
progress on the target side (NIXL over UCX TCP: emulated reads) does so quickly only then.

Owned by the Sender's I/O thread (no locking). A reader counts from its accepted Fetch until its Done (or its
request finishes without one); while any reader counts, agents with an `expect_reads(seconds)` hook are told
"for a lease more" (renewed by the readers' heartbeats), and "no longer" when the last one is done. A Fetch
that carries its Done never counts: its reads are over. The count only steers speed: a reader missed makes its
reads wait for the agent's idle period (they still complete), a reader counted twice keeps the agent fast.
"""

from __future__ import annotations

import logging

log = logging.getLogger("kvbridge.transceiver.sender")

__all__ = ["ReadWatch"]


class ReadWatch:
    """Active readers of one context rank, and the agents told about them.

    Args:
        agents: the rank's transfer agents (those without an `expect_reads` hook are left alone).
        lease_s: how long "peers may be reading" holds without renewal.
    """

    def __init__(self, agents, lease_s: float) -> None:
        self._hooks = [a.expect_reads for a in agents if callable(getattr(a, "expect_reads", None))]
        self._lease_s, self._active = lease_s, 0

    def started(self) -> None:
        """A reader's Fetch was accepted: its reads may be in flight."""
        self._active += 1
        self._tell(self._lease_s)

    def ended(self, n: int = 1) -> None:
        """`n` counted readers are done (their Done came, or their request finished)."""
        if n > 0 and self._active > 0:
            self._active = max(0, self._active - n)
            if not self._active:
                self._tell(0.0)

    def renew(self) -> None:
        """A reader's heartbeat: its reads go on."""
        if self._active:
            self._tell(self._lease_s)

    def _tell(self, seconds: float) -> None:
        for hook in self._hooks:
            try:
                hook(seconds)
            except Exception as e:  # noqa: BLE001 - a hint about speed must never fail a Fetch or a Done
                log.warning("transfer agent hint expect_reads(%g) failed: %s", seconds, e)
