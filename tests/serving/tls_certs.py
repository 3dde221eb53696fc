"""Test certificates, made at test time with the `openssl` command line (nothing is stored in the repository):
a CA, and a server certificate it signed for the given IP addresses (and `localhost`)."""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
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


def _run(*args: str, cwd: str) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(d: str, name: str) -> None:
    _run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2", "-subj", f"/CN=kvbridge test {name}",
         "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)


def make_certs(d: str, ips: tuple[str, ...] = ("127.0.0.1",)) -> Certs:
    """A CA and a server certificate for `ips` and localhost, in folder `d` (created)."""
    os.makedirs(d, exist_ok=True)
    _ca(d, "ca")
    _ca(d, "other-ca")
    _run("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", "host.key", "-out", "host.csr", "-subj", "/CN=kvbridge test host", cwd=d)
    san = ",".join([f"IP:{ip}" for ip in ips] + ["DNS:localhost"])
    with open(os.path.join(d, "host.ext"), "w") as f:
        f.write(f"subjectAltName={san}\nbasicConstraints=critical,CA:FALSE\n"
                "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\n"
                "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n")
    _run("x509", "-req", "-in", "host.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
         "-out", "host.crt", "-days", "2", "-extfile", "host.ext", cwd=d)
    return Certs(*(os.path.join(d, n) for n in ("ca.crt", "host.crt", "host.key", "other-ca.crt")))
