"""`cluster_uri: http://<router>`: the router is the registry. The router's routes over its MemoryStore, and
the Store client that workers (and tools) use to reach them.

Routes (router only; every call carries X-KVBridge-Registry: records.access_proof(key), a value derived from
the internal token, never the token; a wrong or missing proof is 401 and logged):
    POST /internal/registry/set      {key, value, ttl_s, prev_revision}  -> {lease, revision} | 409 {current}
    POST /internal/registry/refresh  {lease}  -> {ok}          POST /internal/registry/revoke {lease}
    GET  /internal/registry/get?key=K         POST /internal/registry/delete {key}
    GET  /internal/registry/list?prefix=P
    GET  /internal/registry/watch?prefix=P&after=R&wait_s=S   changes after revision R, waiting up to S s for
         one; {"snapshot": true, "entries": ...} when R is -1 or older than the kept history
The store only keeps bytes; the router's membership (serving/membership.py) verifies every record's signature
before it routes to it, so a caller with the access proof still cannot register a worker without the key.
"""

from __future__ import annotations

import hmac
import logging
import math
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse

from .memory import MemoryStore
from .records import access_proof
from .store import Change, Conflict, Entry, Snapshot, Store, StoreUnavailable

__all__ = ["HttpStore", "install_routes", "PROOF_HEADER"]

log = logging.getLogger("kvbridge.serving.registry")

PROOF_HEADER = "X-KVBridge-Registry"
PREFIX = "/internal/registry"
WATCH_WAIT_S = 5.0
MAX_KEY = 512


def _entry(d: Any) -> Entry | None:
    if not isinstance(d, dict):
        return None
    return Entry(str(d["key"]), str(d["value"]), int(d["revision"]), str(d.get("lease", "")))


def _entry_json(e: Entry | None) -> dict | None:
    return None if e is None else {"key": e.key, "value": e.value, "revision": e.revision, "lease": e.lease}


class HttpStore(Store):
    """The client of a router's registry.

    Args:
        base_url: the router, e.g. http://10.0.0.5:8000 (https:// with the config's tls).
        key: the registry key (records.registry_key); only its access proof is sent.
        call_timeout_s: the deadline of every call (a long-poll watch waits WATCH_WAIT_S on top of it).
        verify: httpx's certificate check (the deployment's CA context with tls).
    """

    def __init__(self, base_url: str, key: bytes, call_timeout_s: float, verify: Any = True) -> None:
        self.uri = base_url.rstrip("/")
        self.timeout = call_timeout_s
        self._client = httpx.AsyncClient(base_url=self.uri + PREFIX, headers={PROOF_HEADER: access_proof(key)},
                                         timeout=httpx.Timeout(call_timeout_s), verify=verify)

    async def _call(self, method: str, path: str, extra_s: float = 0.0, **kw) -> Any:
        try:
            r = await self._client.request(method, path, timeout=self.timeout + extra_s, **kw)
        except httpx.HTTPError as e:
            raise StoreUnavailable(f"registry {self.uri}: {type(e).__name__} {e}".rstrip()) from None
        if r.status_code == 409:
            body = r.json()
            raise Conflict(str(body.get("key", "")), _entry(body.get("current")))
        if r.status_code != 200:
            raise StoreUnavailable(f"registry {self.uri}{PREFIX}{path}: HTTP {r.status_code} {r.text[:200]}")
        return r.json()

    async def set(self, key: str, value: str, ttl_s: float, prev_revision: int | None = None) -> tuple[str, int]:
        d = await self._call("POST", "/set", json={"key": key, "value": value, "ttl_s": ttl_s,
                                                   "prev_revision": prev_revision})
        return str(d["lease"]), int(d["revision"])

    async def refresh(self, lease: str) -> bool:
        return bool((await self._call("POST", "/refresh", json={"lease": lease}))["ok"])

    async def revoke(self, lease: str) -> None:
        await self._call("POST", "/revoke", json={"lease": lease})

    async def get(self, key: str) -> Entry | None:
        return _entry((await self._call("GET", "/get", params={"key": key}))["entry"])

    async def delete(self, key: str) -> None:
        await self._call("POST", "/delete", json={"key": key})

    async def list(self, prefix: str) -> dict[str, Entry]:
        d = await self._call("GET", "/list", params={"prefix": prefix})
        return {e.key: e for e in map(_entry, d["entries"])}

    async def watch(self, prefix: str) -> AsyncIterator[Snapshot | Change]:
        after = -1
        while True:
            d = await self._call("GET", "/watch", extra_s=WATCH_WAIT_S,
                                 params={"prefix": prefix, "after": after, "wait_s": WATCH_WAIT_S})
            if d["snapshot"]:
                yield Snapshot(int(d["revision"]), {e.key: e for e in map(_entry, d["entries"])})
            for c in d["changes"]:
                yield Change(str(c["kind"]), str(c["key"]), str(c["value"]), int(c["revision"]))
            after = int(d["revision"])

    async def close(self) -> None:
        await self._client.aclose()


def install_routes(app, store: MemoryStore, key: bytes) -> None:
    """Put the registry routes of `store` on the router's FastAPI `app`."""
    want = access_proof(key).encode()

    def check(request: Request) -> None:
        got = request.headers.get(PROOF_HEADER, "").encode("ascii", "replace")
        if not hmac.compare_digest(got, want):
            log.warning("registry: refused a call to %s from %s: the %s proof is %s", request.url.path,
                        request.client.host if request.client else "?", PROOF_HEADER,
                        "wrong" if got else "missing")
            raise HTTPException(401, f"the {PROOF_HEADER} header is missing or wrong")

    async def body(request: Request) -> dict:
        check(request)
        d = await request.json()
        if not isinstance(d, dict):
            raise HTTPException(400, "expected a JSON object")
        return d

    def text(d: dict, k: str, limit: int = MAX_KEY) -> str:
        v = d.get(k)
        if not isinstance(v, str) or not v or len(v) > limit:
            raise HTTPException(400, f"{k}: expected a non-empty string of at most {limit} characters")
        return v

    @app.post(PREFIX + "/set")
    async def _set(request: Request):
        d = await body(request)
        ttl, prev = d.get("ttl_s"), d.get("prev_revision")
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl) or \
                not 0 < ttl <= 3600:
            raise HTTPException(400, "ttl_s: expected seconds in (0, 3600]")
        if prev is not None and (type(prev) is not int or prev < 0):
            raise HTTPException(400, "prev_revision: expected null or an integer >= 0")
        k = text(d, "key")
        try:
            lease, rev = await store.set(k, text(d, "value", 64 << 10), float(ttl), prev)
        except Conflict as e:
            return JSONResponse({"key": k, "current": _entry_json(e.current)}, status_code=409)
        return {"lease": lease, "revision": rev}

    @app.post(PREFIX + "/refresh")
    async def _refresh(request: Request):
        return {"ok": await store.refresh(text(await body(request), "lease"))}

    @app.post(PREFIX + "/revoke")
    async def _revoke(request: Request):
        await store.revoke(text(await body(request), "lease"))
        return {"ok": True}

    @app.post(PREFIX + "/delete")
    async def _delete(request: Request):
        await store.delete(text(await body(request), "key"))
        return {"ok": True}

    @app.get(PREFIX + "/get")
    async def _get(request: Request, key: str):
        check(request)
        return {"entry": _entry_json(await store.get(key))}

    @app.get(PREFIX + "/list")
    async def _list(request: Request, prefix: str):
        check(request)
        return {"entries": [_entry_json(e) for e in (await store.list(prefix)).values()]}

    @app.get(PREFIX + "/watch")
    async def _watch(request: Request, prefix: str, after: int = -1, wait_s: float = WATCH_WAIT_S):
        check(request)
        changes = None if after < 0 else store.changes(prefix, after)
        if changes is not None and not changes:
            await store.wait(after, max(0.0, min(wait_s, WATCH_WAIT_S)))
            changes = store.changes(prefix, after)
        if changes is None:
            entries = await store.list(prefix)
            return {"snapshot": True, "revision": store.revision, "changes": [],
                    "entries": [_entry_json(e) for e in entries.values()]}
        rev = changes[-1].revision if changes else max(after, 0)
        rev = store.revision if not changes else rev
        return {"snapshot": False, "revision": rev, "entries": [],
                "changes": [{"kind": c.kind, "key": c.key, "value": c.value, "revision": c.revision}
                            for c in changes]}
