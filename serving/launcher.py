"""`kvbridge serve CONFIG`: every worker of a config and the router, as local processes, until Ctrl-C.

Owns the processes it starts and nothing else: each worker and the router runs in its own process group
(its rank processes inherit it), so stopping a group leaves no orphan; children also get SIGTERM if the
launcher itself dies (PR_SET_PDEATHSIG, set by the child). Ports 0 in the config are replaced by free ports
and the resolved config is written to a run folder that every child reads. Start-up is bounded
(startup_timeout_s); once all are healthy it watches them, and when one dies it stops the others and exits
1 with a message naming the dead one. Ctrl-C or SIGTERM stop everything (router first, then the workers:
SIGTERM, a grace period, then SIGKILL to each group) and exit 0.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from ..errors import KvBridgeError, ServingError

__all__ = ["Cluster", "main", "die_with_parent"]

PARENT_ENV = "KVBRIDGE_LAUNCHER_PID"


@dataclass
class _Child:
    name: str
    what: str           # "context worker", "generation worker", "router"
    url: str
    proc: subprocess.Popen
    log_path: str | None = None
    tail: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None

    def describe(self) -> str:
        code = self.proc.returncode
        how = (f"was killed by signal {-code} ({signal.Signals(-code).name})" if code is not None and code < 0
               else f"exited with code {code}")
        return f"{self.what} {self.name} ({self.url}, pid {self.proc.pid}) {how}"


class Cluster:
    """The processes of one serving config on this host.

    Args:
        cfg: the validated config (ports 0 get free ports).
        log_dir: write each child's output to <log_dir>/<name>.log; None: print it here, prefixed.
        run_dir: where the resolved config goes (a temporary folder by default).
    """

    def __init__(self, cfg, log_dir: str | None = None, run_dir: str | None = None) -> None:
        from ..executor.launch import free_port

        ports = {s.name: s.port or free_port(s.bind_host if s.bind_host != "0.0.0.0" else "127.0.0.1")
                 for s in cfg.servers()}
        self.cfg = cfg.resolved(ports, cfg.router.port or free_port())
        self.log_dir = log_dir
        self._own_run_dir = run_dir is None
        self.run_dir = run_dir or tempfile.mkdtemp(prefix="kvbridge-serve-")
        self.config_path = os.path.join(self.run_dir, "config.yaml")
        with open(self.config_path, "w", encoding="utf-8") as f:
            f.write(self.cfg.to_yaml())
        self.children: list[_Child] = []

    @property
    def router_url(self) -> str:
        return self.cfg.router.url

    def start(self) -> None:
        """Start every worker, then the router."""
        for s in self.cfg.servers():
            self._spawn(s.name, f"{s.role} worker", s.url,
                        ["worker", "--role", s.role, "--index", str(s.index)])
        self._spawn("router", "router", self.router_url, ["router"])

    def wait_healthy(self, timeout: float | None = None) -> float:
        """Wait until every child answers /health with 200; returns the seconds it took.

        Raises:
            ServingError: a child exited (named, with its last lines of output), or the time ran out.
        """
        import httpx

        t0 = time.monotonic()
        timeout = self.cfg.startup_timeout_s if timeout is None else timeout
        pending = list(self.children)
        with httpx.Client(timeout=1.0) as client:
            while pending:
                dead = self.dead()
                if dead is not None:
                    raise ServingError(f"{dead.describe()} during start-up{self._tail(dead)}")
                for c in list(pending):
                    try:
                        if client.get(c.url + "/health").status_code == 200:
                            pending.remove(c)
                    except httpx.HTTPError:
                        pass
                if pending and time.monotonic() - t0 > timeout:
                    names = ", ".join(c.name for c in pending)
                    raise ServingError(f"{names} not healthy within startup_timeout_s={timeout:g}s"
                                       f"{self._tail(pending[0])}")
                if pending:
                    time.sleep(0.2)
        return time.monotonic() - t0

    def dead(self) -> _Child | None:
        """The first child that has exited, if any."""
        for c in self.children:
            if c.proc.poll() is not None:
                return c
        return None

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop the router, then the workers: SIGTERM, up to `grace_s` to exit, then SIGKILL to each group."""
        order = sorted(self.children, key=lambda c: c.name != "router")
        for c in order:
            if c.proc.poll() is None:
                with _quiet():
                    c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for c in order:
            try:
                c.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for c in order:  # whatever is left in each group (rank processes of a killed worker) goes now
            with _quiet():
                os.killpg(c.proc.pid, signal.SIGKILL)
            try:
                c.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
            if c.reader is not None:
                c.reader.join(2)
        if self._own_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- internals -------------------------------------------------------------------------------------
    def _spawn(self, name: str, what: str, url: str, args: list[str]) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **{PARENT_ENV: str(os.getpid())})
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)  # each worker makes its own
        cmd = [sys.executable, "-m", "kvbridge.cli", *args[:1], "--config", self.config_path, *args[1:]]
        log_path = os.path.join(self.log_dir, f"{name}.log") if self.log_dir else None
        out = open(log_path, "w", encoding="utf-8") if log_path else subprocess.PIPE
        try:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True, text=True)
        finally:
            if log_path:
                out.close()
        c = _Child(name, what, url, proc, log_path)
        if not log_path:
            c.reader = threading.Thread(target=_pump, args=(c,), daemon=True, name=f"kvbridge-log-{name}")
            c.reader.start()
        self.children.append(c)

    def _tail(self, c: _Child, n: int = 15) -> str:
        lines = c.tail
        if c.log_path:
            with _quiet(), open(c.log_path, encoding="utf-8", errors="replace") as f:
                lines = f.read().splitlines()
        lines = lines[-n:]
        return ("; its last output:\n    " + "\n    ".join(lines)) if lines else ""


def _pump(c: _Child) -> None:
    for line in c.proc.stdout:
        line = line.rstrip("\n")
        c.tail = (c.tail + [line])[-50:]
        print(line if line.startswith(f"[{c.name}]") else f"[{c.name}] {line}", flush=True)


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, et, e, tb) -> bool:
        return et is not None and issubclass(et, (OSError, ProcessLookupError))


def die_with_parent() -> None:
    """In a child of `kvbridge serve`: get SIGTERM when the launcher dies (Linux), and check it is alive."""
    want = os.environ.get(PARENT_ENV)
    if not want or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(want):  # the launcher died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="kvbridge serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="the serving config (YAML); see examples/")
    ap.add_argument("--log-dir", default=None, help="write each process's output to LOG_DIR/<name>.log")
    a = ap.parse_args(argv)
    from .config import load_config

    try:
        cluster = Cluster(load_config(a.config), log_dir=a.log_dir)
    except KvBridgeError as e:
        print(f"kvbridge serve: {e}", file=sys.stderr)
        return 2

    def on_term(_sig, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    code = 0
    try:
        cluster.start()
        took = cluster.wait_healthy()
        print(f"kvbridge serve: {len(cluster.children) - 1} workers and the router are healthy "
              f"({took:.1f}s); "
              f"OpenAI API at {cluster.router_url}/v1 — Ctrl-C stops everything", flush=True)
        while True:
            time.sleep(0.5)
            dead = cluster.dead()
            if dead is not None:
                print(f"kvbridge serve: {dead.describe()}; stopping the others", file=sys.stderr, flush=True)
                code = 1
                break
    except ServingError as e:
        print(f"kvbridge serve: {e}\nkvbridge serve: stopping the others", file=sys.stderr, flush=True)
        code = 1
    except KeyboardInterrupt:
        print("kvbridge serve: stopping", file=sys.stderr, flush=True)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the shutdown short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        cluster.stop()
    return code
