"""TLS for kvbridge's HTTP: with a `tls:` section in the serving config, the router and every kvbridge worker
serve HTTPS, and every call kvbridge makes between them (the router's hops and /health probes, a worker's
registration with the router as registry, `kvbridge serve`'s supervision probes) checks the peer's certificate
against the deployment's CA. The internal token then never crosses the network in clear, so workers on other
hosts need no `insecure: true` (which plain HTTP to a non-loopback host still needs: membership.py).

    tls:
      cert: /etc/kvbridge/host.crt   # this host's certificate (PEM, the chain after it); its names (SAN) must
                                     # cover the host every url of this host gives (router.host, urls, --host)
      key: /etc/kvbridge/host.key    # its private key (PEM, unencrypted)
      ca: /etc/kvbridge/ca.crt       # the CA bundle every peer's certificate must chain to

Owns parsing (every error names its key and the file) and the SSL contexts; never opens a socket. The
certificates are loaded when the config is parsed, so a bad file fails `kvbridge check` and start-up, not the
first request. Clients from outside (an OpenAI SDK) trust the same CA
(`httpx.Client(verify=ssl.create_default_context(cafile=ca))`).
vLLM servers (`engine: vllm`, which then needs `disagg_cluster`): each runs under a `kvbridge worker` whose
guard (vllm_guard.py) serves HTTPS with these files in front of it, the server itself on loopback in plain
HTTP. Not covered: etcd's own TLS, and the bytes the `tcp` agent moves (docs/limits.md).
"""

from __future__ import annotations

import functools
import os
import ssl
from dataclasses import dataclass
from typing import Any

from ..errors import ServeConfigError

__all__ = ["TlsSpec", "parse_tls", "client_verify", "server_kwargs", "certificate_error"]

_KEYS = ("cert", "key", "ca")


@dataclass(frozen=True)
class TlsSpec:
    """Where this host's certificate, its key and the deployment's CA bundle are (absolute paths)."""

    cert: str
    key: str
    ca: str

    def client_context(self) -> ssl.SSLContext:
        """The context every kvbridge HTTP client of this deployment uses: TLS 1.2 or later, the peer's
        certificate checked against `ca` and its name against the url's host (one per process and spec)."""
        return _client_context(self.ca)


@functools.lru_cache(maxsize=8)
def _client_context(ca: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=ca)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def client_verify(tls: TlsSpec | None) -> ssl.SSLContext | bool:
    """httpx's `verify` for calls inside the deployment: the CA's context with TLS, else the default (True)."""
    return tls.client_context() if tls is not None else True


def certificate_error(e: BaseException) -> str:
    """The certificate check that failed under an httpx error ("" if none did): a peer whose certificate does
    not chain to the CA or does not name the host it was reached at is a deployment's mistake, not an outage."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(e):
            return str(e)
        e = e.__cause__ or e.__context__
    return ""


def server_kwargs(tls: TlsSpec | None) -> dict[str, str]:
    """uvicorn.Config's TLS arguments: with TLS its server answers only TLS; none without."""
    return {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key} if tls is not None else {}


def parse_tls(d: Any) -> TlsSpec | None:
    """Validate a `tls:` mapping (None: no TLS): three readable PEM files that load as a certificate chain with
    its key and a CA bundle. Raises ServeConfigError naming the key and what was wrong."""
    if d is None:
        return None
    if not isinstance(d, dict):
        raise ServeConfigError(f"tls: expected a mapping of {', '.join(_KEYS)}, got {type(d).__name__}")
    bad = sorted(str(k) for k in d if k not in _KEYS)
    if bad:
        raise ServeConfigError(f"tls.{bad[0]}: unknown key; known keys: {list(_KEYS)}")
    paths = {}
    for k in _KEYS:
        v = d.get(k)
        if not isinstance(v, str) or not v:
            raise ServeConfigError(f"tls.{k}: missing (tls needs cert, key and ca: PEM file paths)")
        p = os.path.abspath(os.path.expanduser(v))
        if not os.path.isfile(p) or not os.access(p, os.R_OK):
            raise ServeConfigError(f"tls.{k}: {v!r} is not a readable file")
        paths[k] = p
    try:
        ssl.create_default_context(cafile=paths["ca"])
    except (ssl.SSLError, ValueError, OSError) as e:
        raise ServeConfigError(f"tls.ca: {paths['ca']} holds no CA certificate in PEM: {e}") from None
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(paths["cert"], paths["key"])
    except (ssl.SSLError, ValueError, OSError) as e:
        raise ServeConfigError(f"tls.cert / tls.key: {paths['cert']} and {paths['key']} do not load as a "
                               f"certificate chain and its private key (PEM, the key unencrypted): {e}") from None
    return TlsSpec(paths["cert"], paths["key"], paths["ca"])
