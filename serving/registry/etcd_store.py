"""`cluster_uri: etcd://host:port`: the Store interface on a real etcd server (v3 API, through `aetcd`, the
`kvbridge[etcd]` extra).

Owns one aetcd client per store; after any failure the client is dropped and the next call connects afresh
(gRPC channels and aetcd's watch stream do not always recover on their own when etcd restarts). A lease is
an etcd lease (TTL rounded up to whole seconds, at least MIN_TTL_S); a conditional set is one transaction
comparing the key's mod revision. A watch takes a snapshot (range read), then watches from the next revision;
while no event arrives it probes etcd every PROBE_S, so a dead etcd is noticed within PROBE_S + the call
timeout even when the watch stream itself stays silent. Never interprets values.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator

from .store import Change, Conflict, Entry, Snapshot, Store, StoreUnavailable

__all__ = ["EtcdStore", "MIN_TTL_S"]

MIN_TTL_S = 2
PROBE_S = 1.0


def _s(b: bytes) -> str:
    return b.decode("utf-8", "replace")


class EtcdStore(Store):
    """Args: host, port: the etcd client URL's; call_timeout_s: the deadline of every call; user, password: etcd's
    auth (a client that reconnects logs in again, so an expired auth token costs one failed call)."""

    def __init__(self, host: str, port: int, call_timeout_s: float, user: str | None = None,
                 password: str | None = None) -> None:
        try:
            import aetcd  # noqa: F401
        except ImportError:
            from ...errors import ServeConfigError

            raise ServeConfigError("cluster_uri etcd://...: the etcd client is not installed; pip install "
                                   "'kvbridge[etcd]' (aetcd)") from None
        self.uri = f"etcd://{host}:{port}"
        self.host, self.port, self.timeout = host, port, call_timeout_s
        self._user, self._password = user, password
        self._client = None

    async def _conn(self):
        import aetcd

        if self._client is None:
            c = aetcd.Client(host=self.host, port=self.port, username=self._user, password=self._password,
                             timeout=self.timeout, connect_wait_timeout=max(1, math.ceil(self.timeout)))
            await asyncio.wait_for(c.connect(), self.timeout)
            self._client = c
        return self._client

    async def _drop(self) -> None:
        c, self._client = self._client, None
        if c is not None:
            try:
                await asyncio.wait_for(c.close(), self.timeout)
            except Exception:  # noqa: BLE001 - the connection is being thrown away anyway
                pass

    async def _do(self, what: str, fn):
        """fn(client) under the call deadline; any failure to reach etcd is StoreUnavailable."""
        try:
            return await asyncio.wait_for(fn(await self._conn()), self.timeout)
        except (Conflict, asyncio.CancelledError):
            raise
        except Exception as e:  # noqa: BLE001 - aetcd raises its own and grpc's errors
            await self._drop()
            raise StoreUnavailable(f"etcd {self.host}:{self.port}: {what}: {type(e).__name__}: "
                                   f"{str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")) from None

    async def set(self, key: str, value: str, ttl_s: float, prev_revision: int | None = None) -> tuple[str, int]:
        k, v = key.encode(), value.encode()

        async def run(c):
            lease = await c.lease(max(MIN_TTL_S, math.ceil(ttl_s)))
            t = c.transactions
            cmp = [] if prev_revision is None else [t.mod(k) == prev_revision]
            ok, _ = await c.transaction(compare=cmp, success=[t.put(k, v, lease=lease.id)], failure=[t.get(k)])
            if not ok:
                await c.revoke_lease(lease.id)
                cur = await c.get(k)
                raise Conflict(key, None if cur is None else Entry(key, _s(cur.value), cur.mod_revision,
                                                                   str(cur.lease or "")))
            got = await c.get(k)
            return str(lease.id), (got.mod_revision if got is not None else 0)

        return await self._do("set", run)

    async def refresh(self, lease: str) -> bool:
        async def run(c):
            reply = await c.refresh_lease(int(lease))
            return reply is not None and reply.TTL > 0

        return await self._do("refresh", run)

    async def revoke(self, lease: str) -> None:
        async def run(c):
            try:
                await c.revoke_lease(int(lease))
            except Exception as e:  # noqa: BLE001 - a lease that is already gone is revoked
                if "not found" not in str(e):
                    raise

        await self._do("revoke", run)

    async def get(self, key: str) -> Entry | None:
        async def run(c):
            got = await c.get(key.encode())
            return None if got is None else Entry(key, _s(got.value), got.mod_revision, str(got.lease or ""))

        return await self._do("get", run)

    async def delete(self, key: str) -> None:
        await self._do("delete", lambda c: c.delete(key.encode()))

    async def _range(self, prefix: str) -> tuple[int, dict[str, Entry]]:
        async def run(c):
            got = await c.get_prefix(prefix.encode())
            entries = {_s(kv.key): Entry(_s(kv.key), _s(kv.value), kv.mod_revision, str(kv.lease or ""))
                       for kv in got}
            return got.header.revision, entries

        return await self._do("list", run)

    async def list(self, prefix: str) -> dict[str, Entry]:
        return (await self._range(prefix))[1]

    async def watch(self, prefix: str) -> AsyncIterator[Snapshot | Change]:
        rev, entries = await self._range(prefix)
        yield Snapshot(rev, entries)
        w = await self._do("watch", lambda c: c.watch_prefix(prefix.encode(), start_revision=rev + 1))
        it = w.__aiter__()
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(it.__anext__(), PROBE_S)
                except asyncio.TimeoutError:
                    await self._do("probe", lambda c: c.get(prefix.encode()))  # a read its user may make
                    continue
                except StopAsyncIteration:
                    raise StoreUnavailable(f"etcd {self.host}:{self.port}: the watch ended") from None
                except StoreUnavailable:
                    raise
                except Exception as e:  # noqa: BLE001 - the watch stream broke
                    await self._drop()
                    raise StoreUnavailable(f"etcd {self.host}:{self.port}: watch: {type(e).__name__}") from None
                kind = "put" if ev.kind == "PUT" else "delete"
                yield Change(kind, _s(ev.kv.key), _s(ev.kv.value) if kind == "put" else "", ev.kv.mod_revision)
        finally:
            try:
                await asyncio.wait_for(w.cancel(), 1.0)
            except Exception:  # noqa: BLE001 - the client may be gone already
                pass

    async def close(self) -> None:
        await self._drop()
