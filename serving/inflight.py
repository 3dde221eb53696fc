"""In-flight accounting that cannot leak: one context manager per count, and the per-process admission bound.

Owns two things. `in_flight` (a context manager) counts requests on one worker (the balancer's `least_loaded`
reads it, and a gauge mirrors it): entered once, left once, whatever path the request takes (success, error, a client gone,
a stream ended). `Admission` bounds what one process holds at once (`max_inflight_requests` requests and
`max_inflight_body_bytes` of request bodies, counted chunk by chunk as they arrive, before a body is whole):
beyond either, the request gets 503 with Retry-After instead of memory. Never decides where a request goes.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from .protocol import ApiError

__all__ = ["Admission", "in_flight"]

RETRY_AFTER_S = 1.0


@contextlib.contextmanager
def in_flight(worker: Any, gauge: Any = None) -> Iterator[None]:
    """Count one request on `worker` (its `in_flight` attribute, and `gauge` if given) for the block."""
    worker.in_flight += 1
    if gauge is not None:
        gauge.inc()
    try:
        yield
    finally:
        worker.in_flight -= 1
        if gauge is not None:
            gauge.dec()


class Admission:
    """The per-process bound on concurrent requests and request-body bytes.

    Args:
        max_requests: requests admitted at once (each holds a slot until its response ended).
        max_body_bytes: request-body bytes held at once by admitted requests.
    """

    def __init__(self, max_requests: int, max_body_bytes: int) -> None:
        self.max_requests, self.max_body_bytes = max_requests, max_body_bytes
        self.requests = 0
        self.body_bytes = 0

    @contextlib.contextmanager
    def request(self) -> Iterator["_Ticket"]:
        """Admit one request (503 + Retry-After when full); its ticket counts the bytes of its body."""
        if self.requests >= self.max_requests:
            raise ApiError(503, f"the server is busy: {self.requests} requests in flight "
                                f"(max_inflight_requests {self.max_requests}); retry later", "server_error",
                           "overloaded", retry_after=RETRY_AFTER_S)
        ticket = _Ticket(self)
        self.requests += 1
        try:
            yield ticket
        finally:
            self.requests -= 1
            self.body_bytes -= ticket.bytes


class _Ticket:
    """One admitted request's share of the body budget (called with each chunk's size as it arrives)."""

    def __init__(self, owner: Admission) -> None:
        self._owner = owner
        self.bytes = 0

    def __call__(self, n: int) -> None:
        a = self._owner
        if a.body_bytes + n > a.max_body_bytes:
            raise ApiError(503, f"the server is busy: {a.body_bytes} bytes of request bodies in flight "
                                f"(max_inflight_body_bytes {a.max_body_bytes}); retry later", "server_error",
                           "overloaded", retry_after=RETRY_AFTER_S)
        a.body_bytes += n
        self.bytes += n
