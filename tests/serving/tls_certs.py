"""Test certificates, made at test time with the `openssl` command line (nothing is stored in the repository):
a CA, and a server certificate it signed for the given IP addresses (and `localhost`)."""

from __future__ import annotations

import shutil
import ssl
from dataclasses import dataclass


@dataclass(frozen=True)
class Certs:
    ca: str
    cert: str
    key: str
    other_ca: str  # a CA that signed nothing here: a client trusting only it must refuse the servers

    def tls(self) -> dict:
        """The serving config's `tls:` section for these files."""
        return {"cert": self.cert, "key": self.key, "ca": self.ca}

    def trust(self, ca: str | None = None) -> ssl.SSLContext:
        """A client's `verify`: trusting `ca` (default: the deployment's CA) and nothing else."""
        return ssl.create_default_context(cafile=ca or self.ca)


def openssl_missing() -> str:
    return "" if shutil.which("openssl") else "needs the openssl command line to make test certificates"


def make_certs(d: str, ips: tuple[str, ...] = ("127.0.0.1",)) -> Certs:
    """A CA and a server certificate for `ips` and localhost, in folder `d` (created; bench/tls_cost.py makes them)."""
    from kvbridge.bench.tls_cost import make_certs as make

    p = make(d, ips)
    return Certs(p["ca"], p["cert"], p["key"], p["other_ca"])
