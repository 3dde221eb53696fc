"""The guard in front of a vLLM server that must be reached from other hosts: every route needs the token.

vLLM checks its API key on `/v1/*` only: its `/invocations` runs completions for anyone, and `/tokenize`,
`/metrics`, `/scale_elastic_ep` answer too (docs/vllm.md). So a vLLM server kvbridge starts listens on
loopback only, and when its member (`kvbridge worker`, serving/vllm_member.py) is to be reached from the
router on another host, this guard listens on the member's address instead and passes on to the loopback
server only calls that carry the deployment's internal token (the `X-KVBridge-Token` header the router sends
on every call to a worker: serving/auth.py's InternalAuth, the same check a kvbridge worker makes). A caller
without it gets 401 naming the header; an unauthenticated `GET /health` gets the server's status code and
nothing else.

An answer is streamed (a streamed completion reaches the router chunk by chunk); a caller that goes away
closes the server's request, so vLLM aborts it and frees its blocks. Hop-by-hop headers and the token are not
passed on. Bounded: a request body of MAX_BODY bytes, connecting to the server 5 s, each read of its answer
READ_TIMEOUT_S (the router's deadline ends a request long before), MAX_CONNECTIONS connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from types import SimpleNamespace

import httpx
import uvicorn

from .auth import TOKEN_HEADER, InternalAuth, authenticated
from .tls import server_kwargs

__all__ = ["VllmGuard", "GuardServer", "guard_app", "guard_server"]

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 600.0
MAX_CONNECTIONS = 256
MAX_BODY = 64 << 20
_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                  b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length",
                  TOKEN_HEADER.lower().encode()})


class VllmGuard:
    """ASGI app that passes an authenticated call on to the vLLM server at `upstream` (http://127.0.0.1:port).
    Put it behind InternalAuth (`guard_app`): 401 to every call without the token but /health."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.client: httpx.AsyncClient | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if self.client is None:
            await _reply(send, 503, {"error": {"message": "the guard is not started", "code": "starting"}})
            return
        if not authenticated(SimpleNamespace(scope=scope)):  # only /health gets here without the token:
            # the server's status, no body
            try:
                r = await self.client.get(self.upstream + "/health", timeout=5.0)
                status = r.status_code
            except httpx.HTTPError:
                status = 503
            await _reply(send, status, None)
            return
        await self._pass_on(scope, receive, send)

    async def _pass_on(self, scope, receive, send) -> None:
        query = scope.get("query_string") or b""
        url = self.upstream + (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
        if query:
            url += "?" + query.decode("latin-1")
        headers = [(k, v) for k, v in scope.get("headers") or () if k.lower() not in _HOP]
        parts, size = [], 0
        while True:  # the request body, whole (a prompt: bounded), so the server gets a Content-Length
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            parts.append(msg.get("body") or b"")
            size += len(parts[-1])
            if size > MAX_BODY:
                await _reply(send, 413, {"error": {"message": f"request body over {MAX_BODY} bytes",
                                                   "code": "body_too_large"}})
                return
            if not msg.get("more_body"):
                break
        req = self.client.build_request(scope["method"], url, headers=headers, content=b"".join(parts))
        try:
            resp = await self.client.send(req, stream=True)
        except httpx.HTTPError as e:
            why = f"the vLLM server behind this guard did not answer: {type(e).__name__}"
            await _reply(send, 502, {"error": {"message": why, "code": "upstream_unreachable"}})
            return
        relay = asyncio.create_task(self._relay(resp, send, scope["path"]))
        gone = asyncio.create_task(_disconnected(receive))
        try:
            await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (relay, gone):
                t.cancel()
            await asyncio.gather(relay, gone, return_exceptions=True)
            await resp.aclose()  # a caller that went away closes the server's request: vLLM aborts it

    @staticmethod
    async def _relay(resp: httpx.Response, send, path: str) -> None:
        try:
            await send({"type": "http.response.start", "status": resp.status_code,
                        "headers": [(k, v) for k, v in resp.headers.raw if k.lower() not in _HOP]})
            async for chunk in resp.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        except httpx.HTTPError as e:  # the server broke off mid-answer: the caller's stream ends short
            log.warning("the vLLM server behind the guard broke off an answer to %s: %s", path, e)

    async def _lifespan(self, receive, send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                self.client = httpx.AsyncClient(
                    timeout=httpx.Timeout(READ_TIMEOUT_S, connect=5.0, pool=10.0),
                    limits=httpx.Limits(max_connections=MAX_CONNECTIONS), trust_env=False)
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                if self.client is not None:
                    await self.client.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _disconnected(receive) -> None:
    """Returns once the caller has gone away (the request's body was read whole before)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _reply(send, status: int, obj) -> None:
    body = json.dumps(obj).encode() if obj is not None else b""
    headers = [(b"content-length", str(len(body)).encode())]
    if obj is not None:
        headers.append((b"content-type", b"application/json"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def guard_server(upstream: str, token: str, tls=None) -> "GuardServer":
    """The guard's uvicorn server (to be served on a socket of `listen.bind`) in front of `upstream`; HTTPS with
    `tls` (the config's tls.TlsSpec: vLLM itself then stays plain HTTP on loopback behind it)."""
    return GuardServer(uvicorn.Config(guard_app(upstream, token), log_level="warning", lifespan="on",
                                      access_log=False, timeout_graceful_shutdown=5,
                                      **server_kwargs(tls)))


def guard_app(upstream: str, token: str):
    """The guard's ASGI app: the token checked (InternalAuth), then passed on to `upstream`."""
    if not token:
        raise ValueError("a vLLM guard needs the deployment's internal token")
    return InternalAuth(VllmGuard(upstream), token)


class GuardServer(uvicorn.Server):
    """uvicorn for the guard inside a member's event loop: the member handles the signals, not uvicorn."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield
