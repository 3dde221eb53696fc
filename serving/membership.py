"""Which workers the router may route to: a fixed list from the config, or a cluster's live membership.

The router asks one object, its WorkerSet, for everything about its workers: `pool(role)` (the balancer's
Pool of that role, whose WorkerRefs carry health and load), `healthy(role)`, `admit()` (503 + Retry-After
until minimal_instances of each role are up: registered and answered /health since they joined), `describe()` (for /health) and `start/stop`. Others hook
in there (a KV-aware index, health probing) without knowing where workers come from.

    StaticWorkers     today's deployment: the config's urls, fixed.
    RegistryWorkers   `disagg_cluster`: watches /kvbridge/<cluster>/workers/ in the registry (registry/): a
                      verified record adds its worker (unhealthy until the router's first /health check, run
                      at once), a delete removes it, a newer incarnation of a worker id replaces the older
                      one, which is retired. Refused by name, logged and counted (never routed to): a record
                      without a valid signature (forged), of a retired or older incarnation
                      (stale_incarnation), of another cluster or model, or whose plain-http URL is not
                      loopback while `insecure` is off (the router would send it the internal token in clear).
                      A registry outage keeps the last membership (health checks go on) and says so in
                      /health and in kvbridge_router_registry_up; the watch restarts from a fresh snapshot.
With an http:// cluster_uri this router holds the registry itself (registry/memory.py) and serves it.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

from ..netaddr import is_loopback
from .balancer import Pool, WorkerRef
from .protocol import ApiError
from .registry import RegistrationRefused, Snapshot, StoreUnavailable, WorkerRecord, open_store, registry_key
from .registry.records import decode, workers_prefix

__all__ = ["WorkerSet", "StaticWorkers", "RegistryWorkers", "worker_set"]

log = logging.getLogger("kvbridge.serving.membership")

ROLES = ("context", "generation")
RETRY_AFTER_S = 2.0
REFUSED_KEPT = 32


class WorkerSet:
    """The workers of one router (the static list; RegistryWorkers overrides what changes)."""

    mode = "static"

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        groups = {"context": cfg.context, "generation": cfg.generation}
        self.pools = {r: Pool([WorkerRef.of(s) for s in groups[r]], cfg.router.policy) for r in ROLES}

    def pool(self, role: str) -> Pool:
        return self.pools[role]

    def healthy(self, role: str) -> list[WorkerRef]:
        return [w for w in self.pools[role].workers if w.healthy]

    def admit(self) -> None:
        """Raise 503 + Retry-After while the deployment is below its minimal instances (static: never)."""

    def install(self, app) -> None:
        """Routes this worker set serves on the router's app (static: none)."""

    async def start(self, on_added: Callable[[WorkerRef], Awaitable[None]],
                    on_removed: Callable[[WorkerRef], None] | None = None) -> None:
        """Watch the membership: `on_added(w)` for a worker that joins, `on_removed(w)` for one that leaves."""

    async def stop(self) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        return {"mode": self.mode}


StaticWorkers = WorkerSet


def worker_set(cfg) -> WorkerSet:
    return WorkerSet(cfg) if cfg.cluster is None else RegistryWorkers(cfg)


@functools.cache
def _families() -> tuple:
    from prometheus_client import Counter, Gauge

    return (Gauge("kvbridge_router_registry_up", "1 while the cluster registry answers (0: last membership)"),
            Gauge("kvbridge_router_cluster_workers", "Workers of each role", ["role", "state"]),
            Counter("kvbridge_router_registrations_refused", "Registry records refused", ["reason"]),
            Gauge("kvbridge_router_role_in_flight", "Requests in flight on the workers of a role (queue depth)",
                  ["role"]),
            Gauge("kvbridge_router_role_utilisation", "In-flight requests per healthy worker of a role",
                  ["role"]))


class RegistryWorkers(WorkerSet):
    """Membership from a registry (see the module docstring)."""

    mode = "registry"

    def __init__(self, cfg) -> None:
        from ..errors import ServeConfigError
        from .auth import internal_token

        super().__init__(cfg)
        for p in self.pools.values():
            p.workers.clear()  # the config's urls are not the membership
        self.spec = cl = cfg.cluster
        token = internal_token(cfg)
        if not token:
            raise ServeConfigError("disagg_cluster: the deployment's internal token is needed (KVBRIDGE_INTERNAL_"
                                   "TOKEN or internal_token): registrations are signed with a key derived from it")
        self.key = registry_key(token, cl.name)
        self.prefix = workers_prefix(cl.name)
        self.memory = None
        if cl.router_registry:
            from .registry.memory import MemoryStore

            self.memory = self.store = MemoryStore(cl.uri)
        else:
            self.store = open_store(cl.uri, self.key, cl.call_timeout_s, cl.etcd_password())
        self.records: dict[str, WorkerRecord] = {}
        self.retired: dict[str, set[str]] = collections.defaultdict(set)
        self.refused: collections.deque[dict] = collections.deque(maxlen=REFUSED_KEPT)
        self.up, self.error, self.since = False, "not connected yet", time.monotonic()
        self._tasks: list[asyncio.Task] = []
        self._seen_up: set[str] = set()  # workers (by id) that answered /health since they (re)joined
        self._on_added: Callable[[WorkerRef], Awaitable[None]] | None = None
        self._on_removed: Callable[[WorkerRef], None] | None = None
        up, workers, self._refused_total, in_flight, util = _families()
        up.set_function(lambda: 1.0 if self.up else 0.0)
        for r in ROLES:
            workers.labels(r, "registered").set_function(lambda r=r: len(self.pools[r].workers))
            workers.labels(r, "healthy").set_function(lambda r=r: len(self.healthy(r)))
            in_flight.labels(r).set_function(lambda r=r: sum(w.in_flight for w in self.pools[r].workers))
            util.labels(r).set_function(lambda r=r: sum(w.in_flight for w in self.pools[r].workers) /
                                        max(1, len(self.healthy(r))))

    # --- the WorkerSet interface ------------------------------------------------------------------------------
    def up_workers(self, role: str) -> list[WorkerRef]:
        """Registered workers of `role` that answered /health since they joined (one slow probe on a busy host
        does not take a worker out of the count; routing still prefers the healthy ones)."""
        self._seen_up.update(w.name for w in self.pools[role].workers if w.healthy)
        return [w for w in self.pools[role].workers if w.name in self._seen_up]

    def admit(self) -> None:
        short = [f"{r} {len(self.up_workers(r))}/{self.spec.minimal_of(r)}" for r in ROLES
                 if len(self.up_workers(r)) < max(1, self.spec.minimal_of(r))]
        if short:
            raise ApiError(503, f"the deployment is below its minimal instances (healthy/needed: "
                                f"{', '.join(short)}); workers join through {self._where}", "server_error",
                           "not_enough_workers", retry_after=RETRY_AFTER_S)

    @property
    def _where(self) -> str:
        return "this router (http://)" if self.memory is not None else self.spec.uri

    def install(self, app) -> None:
        if self.memory is not None:
            from .registry.http_store import install_routes

            install_routes(app, self.memory, self.key)

    async def start(self, on_added, on_removed=None) -> None:
        self._on_added, self._on_removed = on_added, on_removed
        if self.memory is not None:
            self._tasks.append(asyncio.create_task(self.memory.run_sweeper()))
        self._tasks.append(asyncio.create_task(self._watch_loop()))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.store.close()

    def describe(self) -> dict[str, Any]:
        return {"mode": self.mode, "uri": self._where, "cluster": self.spec.name,
                "registry": "ok" if self.up else "unreachable",
                **({} if self.up else {"registry_error": self.error,
                                       "last_membership_age_s": round(time.monotonic() - self.since, 1)}),
                "minimal_instances": dict(self.spec.minimal),
                "workers": {w.name: {"role": r, "url": w.url, "healthy": w.healthy,
                                     "incarnation": self.records[w.name].incarnation}
                            for r in ROLES for w in self.pools[r].workers if w.name in self.records},
                "refused": list(self.refused)[-8:]}

    # --- the watch ------------------------------------------------------------------------------------------
    async def _watch_loop(self) -> None:
        backoff = 0.2
        while True:
            try:
                async for item in self.store.watch(self.prefix):
                    if isinstance(item, Snapshot):
                        self._reconcile(item.entries)
                        if not self.up:
                            log.warning("router: registry %s: watching (%d worker record(s))", self.spec.uri,
                                        len(item.entries))
                        self.up, self.error, backoff = True, "", 0.2
                    elif item.kind == "put":
                        self._put(item.key, item.value)
                    else:
                        self._delete(item.key)
            except StoreUnavailable as e:
                if self.up:
                    log.warning("router: registry %s unreachable (%s); routing on the last membership (%d "
                                "workers)", self.spec.uri, e, len(self.records))
                    self.since = time.monotonic()
                self.up, self.error = False, str(e)
            except Exception as e:  # noqa: BLE001 - the watch must outlive any one bad event
                log.exception("router: registry watch failed; restarting it", exc_info=e)
                self.up, self.error = False, f"{type(e).__name__}: {e}"
                self.since = time.monotonic()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.spec.heartbeat_s)

    def _reconcile(self, entries: dict) -> None:
        for key, e in entries.items():
            self._put(key, e.value)
        present = {k.rsplit("/", 1)[-1] for k in entries}
        for wid in [w for w in self.records if w not in present]:
            self._remove(wid, "gone from the registry")

    def _put(self, key: str, value: str) -> None:
        try:
            rec = self._verify(key, value)
        except RegistrationRefused as e:
            self._refuse(key, e)
            return
        cur = self.records.get(rec.worker_id)
        if cur is not None and cur.incarnation == rec.incarnation and cur == rec:
            return  # the same record again (a re-registration after a lost lease)
        if cur is not None and cur.incarnation != rec.incarnation:
            log.warning("router: %s: incarnation %s replaces %s (%s)", rec.worker_id, rec.incarnation,
                        cur.incarnation, rec.url)
            self.retired[rec.worker_id].add(cur.incarnation)
        if cur is not None:
            self._remove(rec.worker_id, "replaced", quiet=True)
        self.records[rec.worker_id] = rec
        ref = WorkerRef(rec.worker_id, rec.url, rec.role, capacity_tokens=rec.capacity_tokens or None,
                        kv_events=rec.kv_events)
        self.pools[rec.role].workers.append(ref)
        log.warning("router: %s worker %s joined at %s (incarnation %s)", rec.role, rec.worker_id, rec.url,
                    rec.incarnation)
        if self._on_added is not None:
            asyncio.ensure_future(self._on_added(ref))

    def _verify(self, key: str, value: str) -> WorkerRecord:
        rec = decode(key, value, self.key)
        if rec.cluster != self.spec.name:
            raise RegistrationRefused("wrong_cluster", f"{key}: cluster {rec.cluster!r}, not {self.spec.name!r}")
        if rec.model not in (self.cfg.model_name, self.cfg.model):
            raise RegistrationRefused("wrong_model", f"{key}: serves {rec.model!r}; this router serves "
                                                     f"{self.cfg.model_name!r}")
        u = urlsplit(rec.url)
        if u.scheme == "http" and not is_loopback(u.hostname or "") and not self.cfg.insecure:
            raise RegistrationRefused("insecure_url", f"{key}: {rec.url} is plain HTTP to a non-loopback host; "
                                                      f"the router would send it the internal token in clear "
                                                      f"(set insecure: true to accept that)")
        if rec.incarnation in self.retired.get(rec.worker_id, ()):
            raise RegistrationRefused("stale_incarnation", f"{key}: incarnation {rec.incarnation} of "
                                                           f"{rec.worker_id} was replaced by a newer one")
        cur = self.records.get(rec.worker_id)
        if cur is not None and cur.incarnation != rec.incarnation and rec.started_ns < cur.started_ns:
            raise RegistrationRefused("stale_incarnation", f"{key}: incarnation {rec.incarnation} started before "
                                                           f"the registered {cur.incarnation}")
        return rec

    def _refuse(self, key: str, e: RegistrationRefused) -> None:
        log.warning("router: refused a registration: %s", e)
        self._refused_total.labels(e.reason).inc()
        self.refused.append({"key": key, "reason": e.reason, "message": str(e)})

    def _delete(self, key: str) -> None:
        wid = key.rsplit("/", 1)[-1]
        if wid in self.records:
            self._remove(wid, "unregistered or its lease ran out")

    def _remove(self, wid: str, why: str, quiet: bool = False) -> None:
        rec = self.records.pop(wid, None)
        self._seen_up.discard(wid)
        if rec is None:
            return
        pool = self.pools[rec.role]
        gone = [w for w in pool.workers if w.name == wid]
        pool.workers[:] = [w for w in pool.workers if w.name != wid]
        if self._on_removed is not None:
            for w in gone:
                self._on_removed(w)  # e.g. the KV index drops its blocks now
        if not quiet:
            log.warning("router: %s worker %s left (%s)", rec.role, wid, why)
