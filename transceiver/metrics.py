"""Prometheus metrics of the transceiver (served by the workers' /metrics endpoint).

    kvbridge_transfers_total{role, outcome}          finished transfers (generation: ok / the error type;
                                                     context: complete / failed / expired / cancelled)
    kvbridge_transfer_bytes_total                     bytes read by generation ranks
    kvbridge_transfer_fragments_total                 descriptors posted by generation ranks
    kvbridge_phase_seconds{phase}                     handshake+fetch, plan, read, confirm (release), total
    kvbridge_pinned_requests{rank}                    context requests whose blocks are pinned now
    kvbridge_lease_expiries_total                     context requests released because a lease ran out
    kvbridge_transceiver_rejected_peers_total{reason} control-plane peers refused: unauthorised CurveZMQ key
                                                     (key), not CURVE (mechanism), or too many sessions (sessions)

Metrics never fail a transfer: if prometheus_client is missing, everything here is a no-op.
"""

from __future__ import annotations

try:
    from prometheus_client import Counter, Gauge, Histogram

    _BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
    TRANSFERS = Counter("kvbridge_transfers", "Finished KV transfers", ["role", "outcome"])
    BYTES = Counter("kvbridge_transfer_bytes", "Bytes read by generation ranks")
    FRAGMENTS = Counter("kvbridge_transfer_fragments", "Descriptors posted by generation ranks")
    PHASE = Histogram("kvbridge_phase_seconds", "Duration of each transfer phase", ["phase"], buckets=_BUCKETS)
    PINNED = Gauge("kvbridge_pinned_requests", "Context requests with pinned blocks", ["rank"])
    EXPIRIES = Counter("kvbridge_lease_expiries", "Context requests released because a lease expired")
    REJECTED = Counter("kvbridge_transceiver_rejected_peers", "Control-plane peers refused", ["reason"])
    ENABLED = True
except ImportError:  # pragma: no cover
    ENABLED = False

__all__ = ["ENABLED", "on_received", "on_sent", "set_pinned", "on_rejected_peer"]

_PHASES = {"handshake+fetch": "handshake", "plan": "plan", "read": "read", "confirm": "release", "total": "total"}
_children: dict[tuple, object] = {}  # (id(metric), label values) -> its labelled child: labels() costs per call


def _child(metric, *values: str):
    """`metric.labels(*values)`, looked up once: outcomes, phases and ranks are a handful of values each."""
    key = (id(metric), values)  # the metrics are module globals: their ids stay theirs
    c = _children.get(key)
    if c is None:
        c = _children[key] = metric.labels(*values)
    return c


def on_received(result) -> None:
    """Record a generation-side ReceiveResult."""
    if not ENABLED:
        return
    _child(TRANSFERS, "generation", "ok" if result.ok else (result.error_type or "error")).inc()
    if result.ok:
        BYTES.inc(result.nbytes)
        FRAGMENTS.inc(result.fragments)
    for k, v in result.timings_ms.items():
        name = _PHASES.get(k)
        if name is not None:
            _child(PHASE, name).observe(v / 1e3)


def on_sent(status: str) -> None:
    """Record a context-side request finishing with `status`."""
    if not ENABLED:
        return
    _child(TRANSFERS, "context", status).inc()
    if status == "expired":
        EXPIRIES.inc()


def set_pinned(rank: int, n: int) -> None:
    if ENABLED:
        _child(PINNED, str(rank)).set(n)


def on_rejected_peer(reason: str) -> None:
    """Record a refused control-plane peer; `reason` is a short word (key / mechanism / sessions / malformed)."""
    if ENABLED:
        REJECTED.labels(reason).inc()
