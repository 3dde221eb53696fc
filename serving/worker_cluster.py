"""A worker's HTTP server when the config has `disagg_cluster`: uvicorn, plus registration and a drained exit.

Owns the worker's life in a cluster: once uvicorn serves, the Registrar (registration.py) registers and
heartbeats; on SIGTERM or SIGINT the worker unregisters first, answers /health with 503 "draining", keeps
serving what still arrives (a router that has not yet seen the record go still sends here for a moment),
waits until nothing is in flight and no prefilled KV is pinned for a reader (bounded by drain_timeout_sec),
and only then lets uvicorn shut down. A second signal stops at once. A duplicate worker id stops the worker
with `fatal` set (worker.py exits 2). Never touches the executor.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import uvicorn

from .registration import BadCertificate, DuplicateWorker, Registrar

__all__ = ["ClusterServer", "registrar_for", "cluster_registrar", "wait_quiet"]

log = logging.getLogger("kvbridge.serving.worker")

QUIET_S = 0.5  # after unregistering: how long nothing must be in flight before the worker exits


def registrar_for(cfg, spec, st, worker_id: str) -> Registrar:
    """The Registrar of a started worker (its state `st`: executor, endpoints, instance)."""
    from .registry.records import WorkerRecord

    ex = st.backend.ex
    return cluster_registrar(cfg, WorkerRecord(
        cfg.cluster.name, worker_id, spec.role, spec.url, cfg.model_name, st.instance, time.time_ns(),
        tuple(st.endpoints), ex.cfg.num_blocks * ex.cfg.tokens_per_block, spec.tp, spec.pp, ex.layout.to_wire()))


def cluster_registrar(cfg, rec) -> Registrar:
    """The Registrar of WorkerRecord `rec` in cfg's disagg_cluster: its signing key, store and timings."""
    from .auth import internal_headers, internal_token
    from .registry import open_store, registry_key
    from .tls import client_verify

    cl, verify = cfg.cluster, client_verify(cfg.tls)
    key = registry_key(internal_token(cfg) or "", cl.name)
    store = open_store(cl.uri, key, cl.call_timeout_s, cl.etcd_password(), verify)
    return Registrar(store, key, rec, cl.heartbeat_s, cl.ttl_s, internal_headers(cfg),
                     ready_timeout_s=cfg.startup_timeout_s, verify=verify)


async def wait_quiet(busy, t0: float, bound_s: float):
    """Wait until `await busy()` has been falsy for QUIET_S (checked every 50 ms), at most until t0 + bound_s;
    returns the last value it gave (falsy: quiet)."""
    quiet_since = b = None
    while time.monotonic() - t0 < bound_s:
        b = await busy()
        now = time.monotonic()
        if b:
            quiet_since = None
        elif quiet_since is None:
            quiet_since = now
        elif now - quiet_since >= QUIET_S:
            break
        await asyncio.sleep(0.05)
    return b


class ClusterServer(uvicorn.Server):
    """uvicorn.Server that registers after start-up and drains before shutting down (see the module doc)."""

    def __init__(self, config: uvicorn.Config, registrar: Registrar, st, drain_s: float) -> None:
        super().__init__(config)
        self.registrar, self.st, self.drain_s = registrar, st, drain_s
        self.fatal: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._draining = False

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._membership())

    async def _membership(self) -> None:
        try:
            await self.registrar.run()
        except (DuplicateWorker, BadCertificate) as e:
            self.fatal = str(e)
            log.error("%s", e)
            self.should_exit = True
        except TimeoutError as e:
            self.fatal = f"never served, so never registered: {e}"
            self.should_exit = True

    def handle_exit(self, sig: int, frame) -> None:
        if self._draining or self._loop is None or self.should_exit:
            super().handle_exit(sig, frame)
            self.force_exit = True
            return
        self._captured_signals.append(sig)
        self._draining = True
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain(sig)))

    async def _drain(self, sig: int) -> None:
        name, be = self.registrar.record.worker_id, self.st.backend
        t0 = time.monotonic()
        log.warning("%s: %s: leaving the cluster, draining (at most %gs)", name, signal.Signals(sig).name,
                    self.drain_s)
        self.st.draining = True
        await self.registrar.leave()
        if self._task is not None:
            self._task.cancel()
        async def busy():
            return be.in_flight or be.collect_released()

        await wait_quiet(busy, t0, self.drain_s)
        left = be.in_flight + be.collect_released()
        log.warning("%s: drained in %.1fs%s; exiting (pid %d)", name, time.monotonic() - t0,
                    f", {left} request(s) still open at the bound" if left else "", os.getpid())
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        if self._task is not None:
            self._task.cancel()
        if not self.registrar.left:
            await self.registrar.leave()
        try:
            await super().shutdown(sockets)
        finally:
            await self.registrar.store.close()
