"""`kvbridge serve CONFIG`: every worker of a config and the router, as local processes, until Ctrl-C.

Owns the processes it starts and nothing else: each worker and the router runs in its own process group
(its rank processes inherit it), so stopping a group leaves no orphan; children also get SIGTERM if the
launcher itself dies (PR_SET_PDEATHSIG, set by the child). Every child binds its own port (port 0: the
kernel's pick) and announces it in a port file (serving/listen.py); the resolved config, with those ports,
is written to a private run folder (0700) that the router and every restarted worker read, so a restarted
worker comes back on the port it had. The launcher makes the deployment's secrets before any child starts:
the internal HTTP token (KVBRIDGE_INTERNAL_TOKEN, handed down in the environment, never written to disk)
and the CurveZMQ key pairs of the control plane (in the run folder unless `keys_dir` names one); children's
temporary folders live in the run folder too, so nothing under /tmp outlives `serve`, even after a kill -9.
Start-up is bounded (startup_timeout_s); afterwards supervisor.py restarts dead children (or stops, with
on_worker_exit: stop). Ctrl-C or SIGTERM stop everything (router first, then the workers: SIGTERM, a grace
period, then SIGKILL to each group) and exit 0.
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
from ..netaddr import loopback_interfaces
from .auth import TOKEN_ENV, TOKEN_HEADER, check_router_bind, internal_token, new_token
from .auth import api_keys as router_keys
from .tls import client_verify

__all__ = ["Cluster", "main", "die_with_parent"]

PARENT_ENV = "KVBRIDGE_LAUNCHER_PID"
_CURVE_KEYS = ("curve_secret_key_file", "curve_public_key_file", "curve_server_public_key_file",
               "curve_authorized_keys_dir")


@dataclass
class _Child:
    name: str
    what: str           # "context worker", "generation worker", "router"
    role: str           # "context", "generation", "router"
    url: str
    args: list[str]
    proc: subprocess.Popen
    log_path: str | None = None
    tail: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None
    started_at: float = field(default_factory=time.monotonic)

    @property
    def label(self) -> str:
        """What to call it: e.g. "context worker ctx0", or just "router"."""
        return self.what if self.what == self.name else f"{self.what} {self.name}"

    def describe(self) -> str:
        code = self.proc.returncode
        how = (f"was killed by signal {-code} ({signal.Signals(-code).name})" if code is not None and code < 0
               else f"exited with code {code}")
        return f"{self.label} ({self.url}, pid {self.proc.pid}) {how}"


class Cluster:
    """The processes of one serving config on this host.

    Args:
        cfg: the validated config (ports 0: each child binds a free one and announces it).
        log_dir: write each child's output to <log_dir>/<name>.log; None: print it here, prefixed.
        run_dir: where the resolved config goes (a private temporary folder by default, removed by stop()).
        token: the deployment's internal token (default: KVBRIDGE_INTERNAL_TOKEN, the config's, or a new one).
        api_keys: API keys the router accepts besides the config's (`kvbridge serve --api-key`).
    """

    def __init__(self, cfg, log_dir: str | None = None, run_dir: str | None = None, token: str | None = None,
                 api_keys: tuple[str, ...] = ()) -> None:
        self.log_dir = log_dir
        self._own_run_dir = run_dir is None
        self.run_dir = run_dir or tempfile.mkdtemp(prefix="kvbridge-serve-")
        try:
            self.token = token or internal_token(cfg) or new_token()
            self.cfg = _with_curve_keys(cfg.with_api_keys(tuple(api_keys)), self.run_dir)
            check_router_bind(self.cfg.router.bind_host, router_keys(self.cfg), self.cfg.router.insecure)
            self.config_path = os.path.join(self.run_dir, "config.yaml")
            self._write_config()
            os.makedirs(os.path.join(self.run_dir, "tmp"), mode=0o700, exist_ok=True)
        except BaseException:
            self._remove_run_dir()
            raise
        self.children: list[_Child] = []

    @property
    def router_url(self) -> str:
        return self.cfg.router.url

    @property
    def headers(self) -> dict[str, str]:
        """The internal token header, for calls straight to a worker (/health detail, /debug, /metrics)."""
        return {TOKEN_HEADER: self.token}

    def start(self) -> None:
        """Start every worker, wait for their ports, then start the router (it reads the workers' ports); with
        disagg_cluster the router first (workers register with it, or with etcd, once they serve)."""
        timeout = self.cfg.startup_timeout_s
        if self.cfg.cluster is not None:  # the router first: an http:// registry is the router itself
            self._spawn("router", "router", "router", self.router_url, ["router"])
            self.cfg = self.cfg.resolved({}, self._announced(self.children[-1], timeout))
            self.children[-1].url = self.router_url
            self._write_config()
        if self.cfg.engine == "vllm":  # vLLM binds the port number it is given: pick them now
            from .vllm_workers import with_ports

            self.cfg = with_ports(self.cfg)
            self._write_config()
        for s in self.cfg.servers():
            self._spawn(s.name, f"{s.role} worker", s.role, s.url,
                        ["worker", "--role", s.role, "--index", str(s.index)])
        workers = [c for c in self.children if c.role != "router"]
        ports = {c.name: self._announced(c, timeout) for c in workers}
        self.cfg = self.cfg.resolved(ports)
        for c, s in zip(workers, self.cfg.servers()):
            c.url = s.url
        self._write_config()
        if self.cfg.cluster is not None:
            return
        self._spawn("router", "router", "router", self.router_url, ["router"])
        self.cfg = self.cfg.resolved({}, self._announced(self.children[-1], timeout))
        self.children[-1].url = self.router_url
        self._write_config()  # restarts (the router's included) come back on the ports they had

    def wait_healthy(self, timeout: float | None = None) -> float:
        """Wait until every child answers /health with 200; returns the seconds it took.

        Raises:
            ServingError: a child exited (named, with its last lines of output), or the time ran out.
        """
        t0 = time.monotonic()
        timeout = self.cfg.startup_timeout_s if timeout is None else timeout
        pending = list(self.children)
        while pending:
            dead = self.dead()
            if dead is not None:
                raise ServingError(f"{dead.describe()} during start-up{self.tail(dead)}")
            pending = [c for c in pending if not self.healthy(c)]
            if pending and time.monotonic() - t0 > timeout:
                names = ", ".join(c.name for c in pending)
                raise ServingError(f"{names} not healthy within startup_timeout_s={timeout:g}s"
                                   f"{self.tail(pending[0])}")
            if pending:
                time.sleep(0.2)
        return time.monotonic() - t0

    def healthy(self, c: _Child, timeout: float = 1.0) -> bool:
        """Whether child `c` answers /health with 200 now."""
        r = self._health(c, timeout)
        return r is not None and r.status_code == 200

    def silence(self, c: _Child, timeout: float = 1.0) -> float | None:
        """How long child `c` has been silent, by its /health now: None when it gave no answer within `timeout`
        (hung); for an answer (any status: a draining or failed worker still answers) 0.0, or the seconds
        its executor's ranks have answered nothing when it says `stalled` (worker_state.watch_ranks)."""
        r = self._health(c, timeout)
        if r is None:
            return None
        try:
            silent = r.json().get("executor_silent_s") if r.status_code == 503 else None
        except ValueError:  # not JSON (the router answers JSON too; anything else answered all the same)
            silent = None
        return float(silent) if isinstance(silent, (int, float)) and silent > 0 else 0.0

    def _health(self, c: _Child, timeout: float):
        """Child `c`'s answer to GET /health now (an httpx.Response); None when it gave none within `timeout`."""
        import httpx

        try:
            return httpx.get(c.url + "/health", headers=self.headers, timeout=timeout,
                             verify=client_verify(self.cfg.tls))
        except httpx.HTTPError:
            return None

    def kill_hung(self, c: _Child) -> None:
        """SIGKILL child `c`'s process group (a hung child); its death is then seen and handled like any."""
        with _quiet():
            os.killpg(c.proc.pid, signal.SIGKILL)

    def dead(self) -> _Child | None:
        """The first child that has exited, if any."""
        for c in self.children:
            if c.proc.poll() is not None:
                return c
        return None

    def reap(self, c: _Child) -> None:
        """After child `c` exited: kill what is left of its process group (its rank processes)."""
        with _quiet():
            os.killpg(c.proc.pid, signal.SIGKILL)
        if c.reader is not None:
            c.reader.join(2)

    def restart(self, c: _Child) -> None:
        """Start child `c` again, with the same arguments (its port is in the resolved config)."""
        self.children.remove(c)
        self._spawn(c.name, c.what, c.role, c.url, c.args)

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
            self.reap(c)
            try:
                c.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        self._remove_run_dir()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def tail(self, c: _Child, n: int = 15) -> str:
        """The last lines child `c` printed, for an error message."""
        lines = c.tail
        if c.log_path:
            with _quiet(), open(c.log_path, encoding="utf-8", errors="replace") as f:
                lines = f.read().splitlines()
        lines = lines[-n:]
        return ("; its last output:\n    " + "\n    ".join(lines)) if lines else ""

    # --- internals -------------------------------------------------------------------------------------
    def _write_config(self) -> None:
        tmp = self.config_path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(self.cfg.to_yaml())
        os.replace(tmp, self.config_path)  # a child reading it sees the old file or the new one

    def _remove_run_dir(self) -> None:
        if self._own_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _port_file(self, name: str) -> str:
        return os.path.join(self.run_dir, f"{name}.port")

    def _announced(self, c: _Child, timeout: float) -> int:
        from .listen import wait_port_file

        if self.cfg.engine == "vllm" and c.role != "router":
            return int(c.url.rpartition(":")[2])  # a vLLM server: the port it was given

        try:
            return wait_port_file(self._port_file(c.name), timeout, c.proc)
        except ServingError as e:
            raise ServingError(f"{c.label} during start-up: {e}{self.tail(c)}") from None

    def _spawn(self, name: str, what: str, role: str, url: str, args: list[str]) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=os.path.join(self.run_dir, "tmp"),
                   **{PARENT_ENV: str(os.getpid()), TOKEN_ENV: self.token})
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)  # each worker makes its own
        if self.cfg.cluster is None:  # every KV peer runs on this host
            one_host_env(env)
        with _quiet():
            os.unlink(self._port_file(name))
        cmd = [sys.executable, "-m", "kvbridge.cli", *args[:1], "--config", self.config_path,
               "--port-file", self._port_file(name), *args[1:]]
        after_start = None
        if self.cfg.engine == "vllm" and role != "router" and self.cfg.cluster is None:
            # vLLM's own server (serving/vllm_workers.py); with disagg_cluster, a `kvbridge worker` runs it and
            # registers it (vllm_member.py)
            from .vllm_workers import spawn_args

            cmd, env, after_start = spawn_args(self.cfg, role, int(args[-1]), env, self.token)
        log_path = os.path.join(self.log_dir, f"{name}.log") if self.log_dir else None
        out = open(log_path, "a", encoding="utf-8") if log_path else subprocess.PIPE
        try:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True, text=True)
        finally:
            if log_path:
                out.close()
        if after_start is not None:
            after_start(proc)
        c = _Child(name, what, role, url, args, proc, log_path)
        if not log_path:
            c.reader = threading.Thread(target=_pump, args=(c,), daemon=True, name=f"kvbridge-log-{name}")
            c.reader.start()
        self.children.append(c)


# Interfaces a one-host deployment's children keep to loopback unless the environment names others.
ONE_HOST_ENV = ("UCX_NET_DEVICES", "NCCL_SOCKET_IFNAME")


def one_host_env(env: dict[str, str]) -> dict[str, str]:
    """What `_spawn` does to a child's environment when the deployment has no disagg_cluster (so every worker,
    and every KV peer, is a process this launcher starts on this host): UCX's network devices and NCCL's
    bootstrap interface are loopback, unless the caller's environment names them. Left to themselves, UCX
    opens a TCP listener on each network device in every NIXL agent (its TCP transport authenticates no peer
    and emulates one-sided reads and writes in software at the addresses a peer names: docs/security.md), and
    NCCL's ranks listen on the host's first non-loopback interface; on one host, shared memory, CUDA IPC,
    NVLink and loopback carry everything. (gloo's pair sockets: executor/comm.py.) A host without an interface
    named `lo` keeps the libraries' defaults."""
    loopback_interfaces(env, ONE_HOST_ENV)
    return env


def _with_curve_keys(cfg, run_dir: str):
    """`cfg` with CurveZMQ keys for the control plane, made here (or found in keys_dir) unless it has some."""
    if any(s.transceiver.get(k) for s in cfg.servers() for k in _CURVE_KEYS):
        return cfg  # the config brings its own keys
    import zmq.auth

    folder = cfg.keys_dir or os.path.join(run_dir, "keys")
    allowed = os.path.join(folder, "authorized")
    os.makedirs(allowed, mode=0o700, exist_ok=True)
    os.chmod(folder, 0o700)
    paths = {}
    for name in ("context", "generation"):
        public, secret = os.path.join(folder, f"{name}.key"), os.path.join(folder, f"{name}.key_secret")
        if not (os.path.exists(public) and os.path.exists(secret)):
            public, secret = zmq.auth.create_certificates(folder, name)
        os.chmod(secret, 0o600)
        paths[name] = (public, secret)
    shutil.copyfile(paths["generation"][0], os.path.join(allowed, "generation.key"))
    cfg = cfg.with_transceiver("context", {"curve_secret_key_file": paths["context"][1],
                                           "curve_authorized_keys_dir": allowed})
    return cfg.with_transceiver("generation", {"curve_secret_key_file": paths["generation"][1],
                                               "curve_server_public_key_file": paths["context"][0]})


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
    ap.add_argument("--api-key", action="append", default=[],
                    help="an API key the router's /v1/* accepts (repeatable; see also router.api_keys)")
    ap.add_argument("--check", action="store_true",
                    help="validate CONFIG (model, splits, transfer agents) and print the deployment it would "
                         "start; starts nothing (exit 0: valid, 2: invalid)")
    a = ap.parse_args(argv)
    from .agent_check import check_agents
    from .config import load_config
    from .supervisor import Supervisor

    def on_term(_sig, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    cluster, code = None, 0
    try:
        try:
            cfg = load_config(a.config)
            check_agents(cfg)
            cluster = Cluster(cfg, log_dir=a.log_dir, api_keys=tuple(a.api_key))
        except KvBridgeError as e:
            print(f"kvbridge serve: {e}", file=sys.stderr)
            return 2
        cluster.start()
        took = cluster.wait_healthy()
        print(f"kvbridge serve: {len(cluster.children) - 1} workers and the router are healthy "
              f"({took:.1f}s); OpenAI API at {cluster.router_url}/v1 — Ctrl-C stops everything", flush=True)
        code = Supervisor(cluster).run()
    except ServingError as e:
        print(f"kvbridge serve: {e}\nkvbridge serve: stopping the others", file=sys.stderr, flush=True)
        code = 1
    except KeyboardInterrupt:
        print("kvbridge serve: stopping", file=sys.stderr, flush=True)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the shutdown short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if cluster is not None:
            cluster.stop()
    return code
