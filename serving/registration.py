"""A worker's membership in a `disagg_cluster`: register once it serves, heartbeat, re-register, leave.

Owns the worker side of the registry, in this order (each step bounded):
    1. wait until this worker's own HTTP listener answers GET /health with 200 (its transceiver endpoints
       were published before the listener started): nobody is told about a worker that cannot serve yet;
    2. register its signed record (records.py) under /kvbridge/<cluster>/workers/<worker id>, bound to a lease
       of inactive_interval_sec, only if no live worker holds that id: a record left by an earlier incarnation
       whose URL no longer answers with that incarnation is replaced; a live one is a duplicate, and this
       worker stops with an error naming it;
    3. refresh the lease every heartbeat_interval_sec, each call bounded by half an interval (a slow call never
       costs the lease) and check the key still holds this record; a lease that is gone (it ran out during a
       registry outage, or the router holding an http:// registry restarted) or a record removed or
       overwritten in the store is registered again at once; a registry that cannot be
       reached is logged once and retried on the next heartbeat, while the worker keeps serving;
    4. `leave()` (SIGTERM): revoke the lease, so the router stops sending new requests here.
Never stops the worker for a registry outage; only a duplicate worker id is fatal.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from .registry import Conflict, Store, StoreUnavailable
from .registry.records import WorkerRecord, decode, encode, worker_key

__all__ = ["Registrar", "DuplicateWorker", "BadCertificate"]

log = logging.getLogger("kvbridge.serving.registration")
logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per heartbeat


class DuplicateWorker(Exception):
    """Another live worker is registered under this worker's id."""


class BadCertificate(Exception):
    """This worker's certificate does not verify at its own URL (tls): no router could reach it."""


@dataclass
class Registrar:
    store: Store
    key: bytes
    record: WorkerRecord
    heartbeat_s: float
    ttl_s: float
    headers: dict[str, str] = field(default_factory=dict)  # the internal token, for /health calls
    ready_timeout_s: float = 300.0
    verify: Any = True  # httpx's certificate check of the worker's own /health (the CA context with tls)
    lease: str = ""
    _value: str = ""
    registrations: int = 0
    last_error: str = ""
    left: bool = False

    @property
    def store_key(self) -> str:
        return worker_key(self.record.cluster, self.record.worker_id)

    async def run(self) -> None:
        """Steps 1-3 until cancelled; raises DuplicateWorker or BadCertificate (fatal) or TimeoutError (never
        served)."""
        async with httpx.AsyncClient(headers=self.headers, timeout=2.0, verify=self.verify) as http:
            await self._wait_serving(http)
            await self._register_until_done(http)
            outage = False
            while not self.left:
                await asyncio.sleep(self.heartbeat_s)
                if self.left:
                    return
                try:
                    alive = await asyncio.wait_for(self._heartbeat(), self.heartbeat_s / 2)
                except (StoreUnavailable, asyncio.TimeoutError) as e:
                    if not outage:
                        log.warning("%s: heartbeat failed (%s); still serving, retrying every %gs",
                                    self.record.worker_id, _why(e), self.heartbeat_s)
                    outage, self.last_error = True, _why(e)
                    continue
                if outage:
                    log.warning("%s: the registry answers again", self.record.worker_id)
                    outage = False
                if not alive and not self.left:
                    log.warning("%s: its registration is gone (the lease expired, the record was removed, or the "
                                "registry restarted); registering again",
                                self.record.worker_id)
                    await self._register_until_done(http)

    async def _heartbeat(self) -> bool:
        """Refresh the lease; False when it is gone or the key no longer holds this record (deleted or
        overwritten in the registry: an etcd key can go while its lease lives on)."""
        if not await self.store.refresh(self.lease):
            return False
        got = await self.store.get(self.store_key)
        return got is not None and got.value == self._value

    async def leave(self, timeout: float = 2.0) -> None:
        """Revoke the lease (best effort, bounded): the record disappears at once."""
        self.left = True
        if not self.lease:
            return
        try:
            await asyncio.wait_for(self.store.revoke(self.lease), timeout)
            log.warning("%s: unregistered", self.record.worker_id)
        except (StoreUnavailable, asyncio.TimeoutError) as e:
            log.warning("%s: could not unregister (%s); its lease runs out in %gs", self.record.worker_id,
                        _why(e), self.ttl_s)

    async def _wait_serving(self, http: httpx.AsyncClient) -> None:
        """Until this worker's own /health answers 200 at its record's URL (bounded); a certificate that does not
        verify there (tls: not the CA's, or not naming the URL's host) is BadCertificate at once."""
        from .tls import certificate_error

        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            try:
                if (await http.get(self.record.url + "/health")).status_code == 200:
                    return
            except httpx.HTTPError as e:
                why = certificate_error(e)
                if why:
                    raise BadCertificate(f"{self.record.url}: this worker's own certificate does not verify there "
                                         f"against tls.ca (its subjectAltName must name the url's host, and the CA "
                                         f"must have signed it), so the router could not reach it: {why}") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.record.url}/health did not answer 200 within {self.ready_timeout_s:g}s")
            await asyncio.sleep(0.1)

    async def _register_until_done(self, http: httpx.AsyncClient) -> None:
        backoff = min(0.5, self.heartbeat_s)
        while not self.left:
            try:
                await self._register(http)
                return
            except (StoreUnavailable, asyncio.TimeoutError) as e:
                if self.last_error != _why(e):
                    log.warning("%s: cannot register yet (%s); retrying", self.record.worker_id, _why(e))
                self.last_error = _why(e)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.heartbeat_s)

    async def _register(self, http: httpx.AsyncClient) -> None:
        value = self._value = encode(self.record, self.key)
        prev = 0
        for _ in range(3):
            try:
                self.lease, _rev = await asyncio.wait_for(
                    self.store.set(self.store_key, value, self.ttl_s, prev_revision=prev), self.heartbeat_s)
                self.registrations += 1
                self.last_error = ""
                log.warning("%s: registered as %s %s at %s (incarnation %s, lease %gs)", self.record.worker_id,
                            self.record.role, "worker", self.record.url, self.record.incarnation, self.ttl_s)
                return
            except Conflict as e:
                if e.current is None:
                    prev = 0
                    continue
                if not await self._stale(http, e.current.value):
                    raise DuplicateWorker(self._duplicate(e.current.value)) from None
                prev = e.current.revision  # replace the dead incarnation's record (compare-and-swap)
        raise StoreUnavailable(f"{self.store_key}: changed under every registration attempt")

    async def _stale(self, http: httpx.AsyncClient, value: str) -> bool:
        """Whether the record already there belongs to an incarnation that no longer serves at its URL."""
        try:
            old = decode(self.store_key, value, self.key)
        except Exception:  # noqa: BLE001 - a forged or broken record is no live worker
            return True
        if old.incarnation == self.record.incarnation:
            return True
        try:
            r = await http.get(old.url + "/health")
        except httpx.HTTPError:
            return True
        if r.status_code != 200:
            return True
        try:
            body = r.json()
        except ValueError:  # a vLLM server (vllm_member.py) cannot name its incarnation: one that answers at
            return old.url == self.record.url  # another URL is live; at ours it is the one we started
        return not (isinstance(body, dict) and body.get("instance") == old.incarnation)

    def _duplicate(self, value: str) -> str:
        try:
            old = decode(self.store_key, value, self.key)
            held = f"{old.url} (incarnation {old.incarnation})"
        except Exception:  # noqa: BLE001
            held = "another worker"
        return (f"duplicate worker id {self.record.worker_id!r}: it is registered by a live worker at {held}; "
                f"give this worker another --name")


def _why(e: BaseException) -> str:
    return str(e) or type(e).__name__
