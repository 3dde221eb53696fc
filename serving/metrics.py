"""Prometheus metrics of the workers and the router, and how /metrics gathers them across processes.

A worker's executor runs in rank processes, and the transceiver's metrics (transceiver/metrics.py: transfers,
bytes, fragments, phase durations, pinned requests, lease expiries) live there. A worker therefore runs in
prometheus_client's multiprocess mode: `use_multiprocess_dir` points PROMETHEUS_MULTIPROC_DIR at a fresh
folder BEFORE prometheus_client is imported, the spawned rank processes inherit it, and `render` merges every
process's files (counters and histograms summed, gauges per pid or summed over live processes). The router is
one process and uses the default registry.

Worker metrics (label role = context | generation):
    kvbridge_serving_requests_total{role, kind, outcome}   finished HTTP requests (ok / the error code)
    kvbridge_serving_request_seconds{role, phase}          prefill (context), generate (generation), total
    kvbridge_serving_in_flight{role}                       requests being served now
    kvbridge_serving_recomputes_total                      transfers that failed and were recomputed locally
    kvbridge_serving_transfer_seconds                      each request's KV transfer (Completion.transfer's
                                                           timings_ms["total"])
    kvbridge_serving_prefix_tokens_total{role, kind}       prompt tokens (kind=prompt) and those served from
                                                           the prefix cache (kind=reused): hit rate = ratio
    kvbridge_serving_prefix_bytes_saved_total{role}        KV bytes of reused tokens: not computed (context)
                                                           or not moved (generation)
Router metrics:
    kvbridge_router_requests_total{endpoint, status}, kvbridge_router_hop_seconds{hop},
    kvbridge_router_retries_total, kvbridge_router_worker_in_flight{worker}
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..transceiver.stats import TransferStats

__all__ = ["use_multiprocess_dir", "render", "WorkerMetrics", "RouterMetrics"]

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


def use_multiprocess_dir() -> str | None:
    """Turn on multiprocess mode with a fresh folder (unless already on). Call before importing metrics.

    Returns:
        the folder this call created (remove it at exit), or None when the environment already named one.
    """
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return None
    d = tempfile.mkdtemp(prefix="kvbridge-prom-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = d
    return d


def remove_dir(d: str | None) -> None:
    if d:
        shutil.rmtree(d, ignore_errors=True)


def render() -> tuple[bytes, str]:
    """The exposition text of this process, or of every process sharing its multiprocess folder."""
    from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        reg = CollectorRegistry()
        multiprocess.MultiProcessCollector(reg)
        return generate_latest(reg), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


@functools.cache
def _worker_families() -> tuple:
    from prometheus_client import Counter, Gauge, Histogram

    return (Counter("kvbridge_serving_requests", "Finished requests", ["role", "kind", "outcome"]),
            Histogram("kvbridge_serving_request_seconds", "Request phases", ["role", "phase"],
                      buckets=_BUCKETS),
            Gauge("kvbridge_serving_in_flight", "Requests being served", ["role"],
                  multiprocess_mode="livesum"),
            Counter("kvbridge_serving_recomputes", "Failed transfers recomputed locally"),
            Histogram("kvbridge_serving_transfer_seconds", "KV transfer of each request", buckets=_BUCKETS))


@functools.cache
def _router_families() -> tuple:
    from prometheus_client import Counter, Gauge, Histogram

    return (Counter("kvbridge_router_requests", "Requests answered", ["endpoint", "status"]),
            Histogram("kvbridge_router_hop_seconds", "Time per hop", ["hop"], buckets=_BUCKETS),
            Counter("kvbridge_router_retries", "Context hops retried on another worker"),
            Gauge("kvbridge_router_worker_in_flight", "Requests in flight per worker", ["worker"]))


@functools.cache
def _prefix_families() -> tuple:
    from prometheus_client import Counter

    return (Counter("kvbridge_serving_prefix_tokens", "Prompt tokens and prefix-cache hits",
                    ["role", "kind"]),
            Counter("kvbridge_serving_prefix_bytes_saved", "KV bytes of reused prompt tokens", ["role"]))


class WorkerMetrics:
    """One worker's request metrics (the families are registered once per process)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.requests, self.seconds, in_flight, self.recomputes, self.transfer = _worker_families()
        self.in_flight = in_flight.labels(role)

    def done(self, kind: str, outcome: str, total_s: float, phase: str | None = None,
             phase_s: float | None = None) -> None:
        self.requests.labels(self.role, kind, outcome).inc()
        self.seconds.labels(self.role, "total").observe(total_s)
        if phase and phase_s is not None:
            self.seconds.labels(self.role, phase).observe(phase_s)

    def transfer_done(self, stats: TransferStats) -> None:
        """A generation request's KV transfer (Completion.transfer): its total time, when it has one."""
        total = stats.timings_ms.get("total")
        if total is not None:
            self.transfer.observe(total / 1e3)

    def prefix(self, prompt_tokens: int, reused_tokens: int, bytes_per_token: int) -> None:
        """A request's prompt and how much of it the prefix cache served (block reuse)."""
        tokens, saved = _prefix_families()
        tokens.labels(self.role, "prompt").inc(prompt_tokens)
        tokens.labels(self.role, "reused").inc(reused_tokens)
        saved.labels(self.role).inc(reused_tokens * bytes_per_token)


class RouterMetrics:
    """The router's metrics (one process, default registry)."""

    def __init__(self) -> None:
        self.requests, self.hop, self.retries, self.in_flight = _router_families()
