"""Two network namespaces joined by a veth pair, and transceiver rank processes running inside them.

`Link` owns the namespaces and the veth pair (unique names per test run) and always removes them; `NsRank` is
one rank process started with `ip netns exec` (a subprocess: a namespace applies at exec) speaking JSON lines
(netns_rank.py). `netns_unavailable()` says why this machine cannot run such tests (not root, no `ip`, no
permission to create namespaces), or returns "".
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid

from ..transceiver.ranks import ask
from .netns_rank import LineConn

HERE = os.path.dirname(os.path.abspath(__file__))


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns, "ip"] if ns else ["ip"]) + list(args)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=check)


def netns_unavailable(need_tc: bool = False) -> str:
    """Why network-namespace tests (with traffic shaping when need_tc) cannot run here ("" when they can)."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if need_tc and shutil.which("tc") is None:
        return "the `tc` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    name = f"kvbprobe{uuid.uuid4().hex[:6]}"
    try:
        r = _ip("netns", "add", name, check=False)
        if r.returncode:
            return f"`ip netns add` is not permitted here: {r.stderr.strip()}"
        r = _ip("link", "add", name[:15], "type", "veth", "peer", "name", "p" + name[:14], check=False)
        if r.returncode:
            return f"`ip link add ... type veth` is not permitted here: {r.stderr.strip()}"
        _ip("link", "del", name[:15], check=False)
        return ""
    finally:
        _ip("netns", "del", name, check=False)


class Link:
    """Namespaces `ctx` and `gen` joined by veth (ctx_dev 10.77.x.1/24 <-> gen_dev 10.77.x.2/24)."""

    def __init__(self, subnet: int = 77) -> None:
        tag = uuid.uuid4().hex[:6]
        self.ctx_ns, self.gen_ns = f"kvb-c-{tag}", f"kvb-g-{tag}"
        self.ctx_dev, self.gen_dev = f"kvbc{tag}", f"kvbg{tag}"
        self.ctx_ip, self.gen_ip = f"10.{subnet}.0.1", f"10.{subnet}.0.2"
        self._made: list[str] = []
        try:
            for ns in (self.ctx_ns, self.gen_ns):
                _ip("netns", "add", ns)
                self._made.append(ns)
            _ip("link", "add", self.ctx_dev, "type", "veth", "peer", "name", self.gen_dev)
            _ip("link", "set", self.ctx_dev, "netns", self.ctx_ns)
            _ip("link", "set", self.gen_dev, "netns", self.gen_ns)
            for ns, dev, ip in (
                (self.ctx_ns, self.ctx_dev, self.ctx_ip),
                (self.gen_ns, self.gen_dev, self.gen_ip),
            ):
                _ip("addr", "add", f"{ip}/24", "dev", dev, ns=ns)
                _ip("link", "set", dev, "up", ns=ns)
                _ip("link", "set", "lo", "up", ns=ns)
        except BaseException:
            self.close()
            raise

    def set_gen_link(self, up: bool) -> None:
        """Take the generation side's end of the veth down (the link is cut both ways) or up again."""
        _ip("link", "set", self.gen_dev, "up" if up else "down", ns=self.gen_ns)

    def limit_ctx_rate(self, rate: str) -> None:
        """Shape what the context side sends (the KV of a READ) to `rate` (tc syntax, e.g. "16mbit")."""
        subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                self.ctx_ns,
                "tc",
                "qdisc",
                "add",
                "dev",
                self.ctx_dev,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "64kb",
                "latency",
                "200ms",
            ],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )

    def bytes_moved(self) -> int:
        """Bytes received on the generation side's veth so far."""
        out = _ip("-s", "link", "show", self.gen_dev, ns=self.gen_ns).stdout.splitlines()
        i = next(k for k, line in enumerate(out) if line.strip().startswith("RX:"))
        return int(out[i + 1].split()[0])

    def close(self) -> None:
        for ns in self._made:  # deleting a namespace deletes the veth end inside it, and so the pair
            _ip("netns", "del", ns, check=False)
        self._made = []


class NsRank:
    """A rank process in a namespace, with the interface of tests/transceiver/ranks.py's RankProc."""

    def __init__(self, ns: str, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, os.path.join(HERE, "netns_rank.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            env={**os.environ, **env},
        )
        self.conn = LineConn(self.proc.stdout, self.proc.stdin)

    def call(self, cmd: str, arg=None, timeout: float = 120):
        return ask(self.conn, cmd, arg, timeout)

    def close(self) -> None:
        try:
            self.call("exit", timeout=20)
        except (OSError, TimeoutError, EOFError, RuntimeError, ValueError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
