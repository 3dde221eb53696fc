"""What `tls:` costs a request: the same small deployment over plain HTTP and over HTTPS (serving/tls.py).

Starts a deployment of the seeded tiny model (one context worker, one generation worker, the tcp agent, all
on this host) twice, plain and with a test CA and host certificate made by the `openssl` command line, and
times OpenAI completions from a client on this host: one at a time on one kept-alive connection (what a
client with a connection pool sees: the router's own connections to the workers are kept alive too), and each
on a new connection (its TLS handshake included). Each row: mode, connection, p50 / p90 ms, requests.

    python -m kvbridge.bench.tls_cost [--requests 200] [--json PATH] [--png PATH]
"""

from __future__ import annotations

import argparse
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import time

import numpy as np

from .common import finish, machine, output_args, table
from .plot import p50_p90_bars

PROMPT = list(range(40, 72))


def make_certs(folder: str, ips: tuple[str, ...] = ("127.0.0.1",)) -> dict[str, str]:
    """A CA and a server certificate it signed for `ips` and localhost, plus a CA that signed nothing, made with
    openssl in `folder`: their paths as {"ca", "cert", "key", "other_ca"} (nothing is stored in the repository;
    the tests use them too)."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True, timeout=60)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    os.makedirs(folder, exist_ok=True)
    for ca in ("ca", "other-ca"):
        run("req", "-x509", *ec, "-keyout", f"{ca}.key", "-out", f"{ca}.crt", "-days", "2", "-subj",
            f"/CN=kvbridge test {ca}", "-addext", "basicConstraints=critical,CA:TRUE", "-addext",
            "keyUsage=critical,keyCertSign,cRLSign")
    run("req", "-new", *ec, "-keyout", "host.key", "-out", "host.csr", "-subj", "/CN=kvbridge test host")
    san = ",".join([f"IP:{ip}" for ip in ips] + ["DNS:localhost"])
    with open(os.path.join(folder, "host.ext"), "w") as f:
        f.write(f"subjectAltName={san}\nbasicConstraints=critical,CA:FALSE\n"
                "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\n"
                "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n")
    run("x509", "-req", "-in", "host.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out",
        "host.crt", "-days", "2", "-extfile", "host.ext")
    return {k: os.path.join(folder, f) for k, f in (("ca", "ca.crt"), ("cert", "host.crt"), ("key", "host.key"),
                                                     ("other_ca", "other-ca.crt"))}


def _config(tls: dict | None) -> dict:
    d = {"model": "seeded:tiny3",
         "executor": {"num_blocks": 64, "tokens_per_block": 8, "threads_per_rank": 1, "timeout_s": 120},
         "transceiver": {"agent": "tcp"}, "router": {"port": 0, "request_timeout_s": 120},
         "context_servers": {"tp": 1}, "generation_servers": {"tp": 1}}
    return {**d, "tls": tls} if tls else d


def _times(url: str, verify, n: int, reuse: bool) -> np.ndarray:
    import httpx

    body = {"model": "seeded:tiny3", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    out = np.empty(n)
    client = httpx.Client(verify=verify, timeout=60) if reuse else None
    try:
        for i in range(n):
            t = time.perf_counter()
            if reuse:
                r = client.post(url + "/v1/completions", json=body)
            else:
                with httpx.Client(verify=verify, timeout=60) as c:
                    r = c.post(url + "/v1/completions", json=body)
            r.raise_for_status()
            out[i] = time.perf_counter() - t
    finally:
        if client is not None:
            client.close()
    return out * 1e3


def run(requests: int, log_dir: str) -> list[dict]:
    from ..serving.config import parse_config
    from ..serving.launcher import Cluster

    rows = []
    with tempfile.TemporaryDirectory(prefix="kvb-tls-") as d:
        certs = make_certs(d)
        tls = {k: certs[k] for k in ("cert", "key", "ca")}
        for mode in ("http", "https"):
            c = Cluster(parse_config(_config(tls if mode == "https" else None)), log_dir=log_dir)
            try:
                c.start()
                c.wait_healthy(240)
                verify = ssl.create_default_context(cafile=certs["ca"]) if mode == "https" else True
                _times(c.router_url, verify, 10, True)  # warm-up: the executors, the router's pools
                for reuse, n in ((True, requests), (False, max(1, requests // 4))):
                    ms = _times(c.router_url, verify, n, reuse)
                    rows.append({"mode": mode, "connection": "kept alive" if reuse else "new each request",
                                 "p50_ms": round(float(np.median(ms)), 3),
                                 "p90_ms": round(float(np.percentile(ms, 90)), 3), "requests": n})
                    print(table(rows[-1:], list(rows[-1])), flush=True)
            finally:
                c.stop()
    return rows


def _png(path: str, rows: list[dict]) -> None:
    p50_p90_bars(path, [f"{r['mode']}\n{r['connection']}" for r in rows], [r["p50_ms"] for r in rows],
                 [r["p90_ms"] for r in rows], "completion (2 tokens), ms",
                 f"tls_cost: plain HTTP vs HTTPS through the router ({machine()[:50]})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvbridge.bench.tls_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200, help="requests per mode on a kept-alive connection "
                                                              "(a quarter as many on new connections)")
    output_args(ap)
    a = ap.parse_args(argv)
    if a.requests < 1:
        ap.error("--requests must be at least 1")
    if not shutil.which("openssl"):
        print("tls_cost: needs the openssl command line to make its test certificates", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kvb-tls-logs-") as logs:
        finish(run(a.requests, logs), a, _png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
