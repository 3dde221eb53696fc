"""The router's view of a worker's health: one `/health` probe, and how many misses take a worker out.

Owns the rule only (the router owns the loop and the HTTP client): a probe that answers 200 puts a worker
in; a refused connection takes it out at once (nothing listens: it died or is restarting); anything else
that goes wrong (a slow answer on a loaded host, a reset, a 5xx) takes it out only after
`router.health_failures` consecutive misses (default 3), each probe bounded by `router.health_timeout_s`
(default 5 s). Until then the worker keeps serving and its last error is kept for the 503 message.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx

from .balancer import WorkerRef

__all__ = ["HealthRule", "probe"]

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_FAILURES = 3


@dataclass
class HealthRule:
    """Consecutive-miss counting per worker."""

    failures: int = DEFAULT_FAILURES
    _misses: dict[str, int] = field(default_factory=dict)

    def saw(self, w: WorkerRef, ok: bool, error: str = "", refused: bool = False) -> None:
        """Record one probe's outcome and mark the worker accordingly."""
        if ok:
            self._misses[w.name] = 0
            w.mark(True)
            return
        n = self._misses[w.name] = self._misses.get(w.name, 0) + 1
        if refused or n >= self.failures or not w.healthy:
            w.mark(False, error)
        else:
            w.last_error = f"{error} (miss {n} of {self.failures} before removal)"


def _capacity(body: dict | None) -> int | None:
    cap = body.get("capacity_tokens") if body is not None else None
    return cap if type(cap) is int and cap > 0 else None


def _why(body: dict | None) -> str:
    """': <status>: <error>' of a worker's non-200 /health (failed, draining, stalled), or ''."""
    if body is None or not isinstance(body.get("status"), str):
        return ""
    err = body.get("error")
    return f": {body['status'][:20]}" + (f": {err[:200]}" if isinstance(err, str) and err else "")


async def probe(client: httpx.AsyncClient, w: WorkerRef, timeout: httpx.Timeout, rule: HealthRule
                ) -> dict | None:
    """GET the worker's /health once, bounded by `timeout`, and apply `rule` to the outcome; returns the
    answer's JSON object when it answered 200 (None otherwise)."""
    from .relay import json_or_none
    from .tls import certificate_error

    try:
        r = await client.get(w.url + "/health", timeout=timeout)
    except httpx.ConnectError as e:  # refused (or unroutable): nothing is listening; or its certificate failed
        bad_cert = certificate_error(e)
        rule.saw(w, False, f"/health: {type(e).__name__}" + (f": its certificate: {bad_cert}" if bad_cert else ""),
                 refused=True)
        return None
    except httpx.HTTPError as e:
        rule.saw(w, False, f"/health: {type(e).__name__}")
        return None
    body = json_or_none(r.content)  # the answer's JSON object, parsed once
    body = body if isinstance(body, dict) else None
    ok = r.status_code == 200
    rule.saw(w, ok, "" if ok else f"/health answered {r.status_code}" + _why(body))
    w.capacity_tokens = _capacity(body)
    return body if ok else None
