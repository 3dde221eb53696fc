"""A real etcd server for the cluster tests: started on loopback in a temporary data folder, stopped (and
started again on the same ports and data, for an outage) by the test. Skips with the reason when the `etcd`
binary or the `aetcd` client is missing (`make test` installs both: Debian's etcd-server, kvbridge[etcd])."""

from __future__ import annotations

import base64
import os
import shutil
import signal
import subprocess
import time

import httpx
import pytest

from kvbridge.netaddr import free_port


def etcd_unavailable() -> str | None:
    if shutil.which("etcd") is None:
        return "no etcd binary (apt-get install etcd-server; `make test` does it)"
    try:
        import aetcd  # noqa: F401
    except ImportError:
        return "the etcd client is not installed (pip install 'kvbridge[etcd]')"
    return None


class EtcdServer:
    def __init__(self, data_dir: str, log_path: str, also_on: str | None = None) -> None:
        """also_on: another local address etcd's client port listens on (besides 127.0.0.1)."""
        why = etcd_unavailable()
        if why:
            pytest.skip(why)
        self.data_dir, self.log_path, self.also_on = data_dir, log_path, also_on
        self.client_port, self.peer_port = free_port(), free_port()  # below the ephemeral range
        self.proc: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        return f"etcd://127.0.0.1:{self.client_port}"

    def start(self, timeout: float = 60) -> EtcdServer:
        c, p = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        with open(self.log_path, "a") as out:
            self.proc = subprocess.Popen(
                ["etcd", "--name", "kvb", "--data-dir", self.data_dir, "--listen-client-urls",
                 c + (f",http://{self.also_on}:{self.client_port}" if self.also_on else ""),
                 "--advertise-client-urls", c, "--listen-peer-urls", p, "--initial-advertise-peer-urls", p,
                 "--initial-cluster", f"kvb={p}"], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"etcd exited with {self.proc.returncode}; see {self.log_path}"
            try:
                if httpx.get(c + "/health", timeout=2).json().get("health") == "true":
                    return self
            except (httpx.HTTPError, ValueError):
                pass
            assert time.monotonic() < deadline, f"etcd not healthy within {timeout}s; see {self.log_path}"
            time.sleep(0.2)

    def stop(self) -> None:
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)

    def enable_auth(self, user: str, password: str, prefixes: tuple[str, ...] = ("/kvbridge/",)) -> None:
        """etcd's authentication on, as a production etcd runs: a root user (etcd needs one; a random password
        nobody uses) and `user`, whose role may read and write only keys under `prefixes`; from then on every
        call must log in. Through etcd's JSON gateway (/v3/auth/*), as etcdctl would."""
        c = f"http://127.0.0.1:{self.client_port}"
        b64 = lambda s: base64.b64encode(s.encode()).decode()  # noqa: E731
        perms = [("/v3/auth/role/grant", {"name": "kvbridge", "perm": {
            "permType": "READWRITE", "key": b64(p), "range_end": b64(p[:-1] + chr(ord(p[-1]) + 1))}})
            for p in prefixes]
        for path, body in (("/v3/auth/role/add", {"name": "root"}),
                           ("/v3/auth/user/add", {"name": "root", "password": os.urandom(16).hex()}),
                           ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
                           ("/v3/auth/role/add", {"name": "kvbridge"}), *perms,
                           ("/v3/auth/user/add", {"name": user, "password": password}),
                           ("/v3/auth/user/grant", {"user": user, "role": "kvbridge"}), ("/v3/auth/enable", {})):
            r = httpx.post(c + path, json=body, timeout=10)
            assert r.status_code == 200, f"etcd {path}: {r.status_code} {r.text}"
