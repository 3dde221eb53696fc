"""Worker pools of the router: which workers exist, which answered /health, and which one gets a request.

Policies:
    round_robin   the next healthy worker in turn
    least_loaded  the healthy worker with the fewest requests this router has in flight on it (ties in turn)
A worker that refused a connection or failed /health is skipped until its /health answers 200 again; when
every worker of a pool looks unhealthy, they are tried anyway (health may be stale) rather than failing
without trying. Owns no sockets: the router polls /health and reports what it saw.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import POLICIES, ServerSpec

__all__ = ["WorkerRef", "Pool"]


@dataclass
class WorkerRef:
    name: str
    url: str
    role: str
    healthy: bool = False  # until its /health answered 200 (requests still try it when none is healthy)
    in_flight: int = 0
    last_error: str = "not checked yet"
    capacity_tokens: int | None = None  # tokens its KV pool holds (from /health; None: not known)

    @classmethod
    def of(cls, spec: ServerSpec) -> "WorkerRef":
        return cls(spec.name, spec.url, spec.role)

    def mark(self, healthy: bool, error: str = "") -> None:
        self.healthy = healthy
        if error:
            self.last_error = error


class Pool:
    """The workers of one role.

    Args:
        workers: the workers, in config order.
        policy: one of POLICIES.
    """

    def __init__(self, workers: list[WorkerRef], policy: str) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r} is not one of {POLICIES}")
        self.workers = list(workers)
        self.policy = policy
        self._next = 0

    def pick(self, exclude: set[str] = frozenset(), healthy_only: bool = False) -> WorkerRef | None:
        """The worker for the next request, not one named in `exclude`; None when none is left (or, with
        `healthy_only`, when none of those left is healthy)."""
        left = [w for w in self.workers if w.name not in exclude]
        pool = [w for w in left if w.healthy] or ([] if healthy_only else left)
        if not pool:
            return None
        n = len(self.workers)
        order = sorted(pool, key=lambda w: (self.workers.index(w) - self._next) % n)
        w = min(order, key=lambda w: w.in_flight) if self.policy == "least_loaded" else order[0]
        self._next = (self.workers.index(w) + 1) % n
        return w

    def describe(self) -> str:
        return ", ".join(f"{w.name} ({'ok' if w.healthy else w.last_error or 'unhealthy'})"
                         for w in self.workers)
