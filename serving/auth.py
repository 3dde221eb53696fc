"""HTTP authentication of a deployment: the internal token between its own processes, API keys at the router.

Owns two ASGI middlewares and the rules for where a process may listen without them:
    InternalAuth  on every worker: a call without the deployment's internal token (header X-KVBridge-Token)
                  gets 401 before any work (the body is not even read); GET /health is the one exception
                  and the worker shows its detail only to callers that carry the token (`authenticated`).
    ApiKeyAuth    on the router: with API keys configured, /v1/* and /metrics need `Authorization: Bearer
                  <key>` (else an OpenAI-style 401); /health answers everyone, in detail only with a key
                  (`key_ok`); the registry routes of a router that is the registry check their own proof.
A router with no API keys listens only on loopback unless `router.insecure: true` (`check_router_bind`).
Tokens and keys are compared with hmac.compare_digest. The token comes from the environment
(KVBRIDGE_INTERNAL_TOKEN, how `kvbridge serve` hands it to its children) or the config's `internal_token`
(workers on other hosts); API keys from `router.api_keys`, `--api-key` or KVBRIDGE_API_KEY (comma-separated).
Never logs a token or a key, and never decides what a route does: it only lets a call in or not.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets

from ..errors import ServeConfigError
from ..netaddr import is_loopback

log = logging.getLogger("kvbridge.serving.auth")

__all__ = ["TOKEN_HEADER", "TOKEN_ENV", "API_KEY_ENV", "new_token", "internal_token", "internal_headers",
           "api_keys", "is_loopback", "check_worker_bind", "check_router_bind", "InternalAuth", "ApiKeyAuth",
           "authenticated", "key_ok", "install_api_keys"]

TOKEN_HEADER = "X-KVBridge-Token"
TOKEN_ENV = "KVBRIDGE_INTERNAL_TOKEN"
API_KEY_ENV = "KVBRIDGE_API_KEY"
_SCOPE_KEY = "kvbridge_internal_ok"
_KEY_SCOPE = "kvbridge_api_key_ok"
_OPEN_PATHS = frozenset({"/health"})
_KEYED = ("/v1/", "/metrics")  # the router's paths a key guards (prefixes)


def new_token() -> str:
    """A fresh random deployment token (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def internal_token(cfg) -> str | None:
    """The deployment's internal token: the environment first, then the config's `internal_token`."""
    return os.environ.get(TOKEN_ENV) or getattr(cfg, "internal_token", None) or None


def internal_headers(cfg) -> dict[str, str]:
    """Headers that carry the internal token on calls to workers ({} when there is none)."""
    token = internal_token(cfg)
    return {TOKEN_HEADER: token} if token else {}


def api_keys(cfg, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The router's API keys: `router.api_keys`, then `extra` (from --api-key), then KVBRIDGE_API_KEY."""
    env = tuple(k.strip() for k in os.environ.get(API_KEY_ENV, "").split(",") if k.strip())
    return tuple(dict.fromkeys((*cfg.router.api_keys, *extra, *env)))


def check_worker_bind(name: str, bind_host: str, token: str | None, insecure: bool) -> None:
    """Refuse an unauthenticated worker on a non-loopback address unless the config says `insecure: true`.

    Raises:
        ServeConfigError: no token and a non-loopback bind_host without `insecure: true`.
    """
    if token:
        return
    if not is_loopback(bind_host) and not insecure:
        raise ServeConfigError(
            f"{name} would listen on {bind_host} without an internal token: anyone who reaches it could run "
            f"requests and read other clients' answers. Set {TOKEN_ENV} (or internal_token in the config) to "
            f"the deployment's token, bind 127.0.0.1, or set insecure: true to accept that")
    log.warning("%s: no internal token configured; its HTTP API is open to every local process on %s "
                "(`kvbridge serve` always sets one)%s", name, bind_host,
                "; insecure: true in the config" if insecure else "")


def check_router_bind(bind_host: str, keys: tuple[str, ...], insecure: bool) -> None:
    """Refuse a router with no API keys on a non-loopback address unless `router.insecure: true`.

    Raises:
        ServeConfigError: no keys and a non-loopback bind_host without `router.insecure: true`.
    """
    if not (keys or is_loopback(bind_host) or insecure):
        raise ServeConfigError(
            f"the router would listen on {bind_host} with no API keys: anyone who reaches it could use the "
            f"model and read the deployment's metrics. Set router.api_keys (or --api-key, {API_KEY_ENV}), bind "
            f"127.0.0.1, or set router: {{insecure: true}} to accept that")


def authenticated(request) -> bool:
    """Whether the request carried the right internal token (True where the worker has no token)."""
    return bool(request.scope.get(_SCOPE_KEY, False))


def key_ok(request) -> bool:
    """Whether the request carried one of the router's API keys (True where the router has none)."""
    return bool(request.scope.get(_KEY_SCOPE, True))


def _header(scope, name: bytes) -> str:
    for k, v in scope.get("headers") or ():
        if k.lower() == name:
            return v.decode("latin-1")
    return ""


def _same(given: str, want: str) -> bool:
    return hmac.compare_digest(given.encode("utf-8", "replace"), want.encode("utf-8", "replace"))


async def _reply_401(send, message: str, code: str, extra_headers: list | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *(extra_headers or [])]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class InternalAuth:
    """ASGI middleware of a worker: the internal token or 401 (GET /health answers both, in less detail).

    Args:
        app: the ASGI application behind it.
        token: the deployment's token; None lets every call in (a hand-started loopback worker).
    """

    def __init__(self, app, token: str | None) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ok = self.token is None or _same(_header(scope, TOKEN_HEADER.lower().encode()), self.token)
        scope[_SCOPE_KEY] = ok
        if not ok and scope.get("path") not in _OPEN_PATHS:
            await _reply_401(send, f"this is an internal kvbridge endpoint: the {TOKEN_HEADER} header is "
                                   f"missing or wrong", "invalid_internal_token")
            return
        await self.app(scope, receive, send)


class ApiKeyAuth:
    """ASGI middleware of the router: with keys configured, /v1/* and /metrics need `Authorization: Bearer
    <key>`; every request is marked with whether it carried one (`key_ok`: /health's detail).

    Args:
        app: the ASGI application behind it.
        keys: the accepted API keys (empty: every call is let in).
    """

    def __init__(self, app, keys: tuple[str, ...]) -> None:
        self.app = app
        self.keys = tuple(keys)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self.keys:
            await self.app(scope, receive, send)
            return
        auth = _header(scope, b"authorization")
        scheme, _, given = auth.partition(" ")
        ok = False
        if scheme.lower() == "bearer" and given.strip():
            for k in self.keys:  # every key compared, so timing does not tell which one nearly matched
                ok |= _same(given.strip(), k)
        scope[_KEY_SCOPE] = ok
        if not ok and str(scope.get("path", "")).startswith(_KEYED):
            why = "missing" if not auth else "not a valid API key"
            await _reply_401(send, f"Authorization: Bearer <API key> is {why}", "invalid_api_key",
                             [(b"www-authenticate", b"Bearer")])
            return
        await self.app(scope, receive, send)


def install_api_keys(app, cfg, keys: tuple[str, ...]) -> None:
    """Put ApiKeyAuth in front of the router; refuse a non-loopback router with no keys (`check_router_bind`),
    and warn once, in the router's own process, when `router.insecure: true` lets one start."""
    check_router_bind(cfg.router.bind_host, keys, cfg.router.insecure)
    if keys:
        app.add_middleware(ApiKeyAuth, keys=keys)
    elif not is_loopback(cfg.router.bind_host):
        log.warning("router: listening on %s with no API keys (router.insecure: true): anyone who reaches it "
                    "can use the model", cfg.router.bind_host)
