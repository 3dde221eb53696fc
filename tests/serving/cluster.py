"""Test helpers for serving: launch a config's workers and router (real processes, real HTTP), start one
worker or router by hand (it binds port 0 itself and announces the port it got: no free-port-then-bind race), compute the aggregated reference, read server-sent events, poll pools back to full."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time

import httpx
import yaml

from kvbridge.executor.runtime import Executor, ExecutorConfig
from kvbridge.serving.auth import TOKEN_ENV, TOKEN_HEADER
from kvbridge.serving.config import parse_config
from kvbridge.serving.launcher import Cluster
from kvbridge.serving.listen import wait_port_file

MODEL = "seeded:tiny3"
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], list(range(40, 77)), [3, 1, 4, 1, 5, 9, 2, 6]]
# Generous for a busy 2-core box: a context rank starved for a few seconds must not fail a test's transfer.
# peer_timeout_s also outlasts the idle gaps between a module's tests: transceiver/receiver.py counts a peer's
# silence from its last frame even across an idle spell, so the first pull after an idle gap longer than
# peer_timeout_s fails with PeerGone (reported to the transceiver's owner).
# One internal token for every deployment a test starts (launch, start_process): hand-started processes can
# then join a launched deployment, and the helpers below can read the workers' /health, /debug and /metrics.
TOKEN = secrets.token_urlsafe(32)
HEADERS = {TOKEN_HEADER: TOKEN}
PATIENT = {"transfer_timeout_s": 60, "peer_timeout_s": 300, "lease_s": 30, "heartbeat_s": 1}


def exact_config() -> dict:
    """A small deployment (tcp agent, positional KV digests on) whose generation side pulls every prompt whole,
    so its KV must equal the context side's byte for byte (kvcheck.py: a prefix it reused could come from an
    earlier prefill that rounded differently)."""
    return {
        "model": MODEL,
        "executor": {"num_blocks": 64, "tokens_per_block": 8, "threads_per_rank": 1, "timeout_s": 120,
                     "kv_digests": True},
        "transceiver": {"agent": "tcp", "handshake_timeout_s": 3, **PATIENT},
        "router": {"port": 0, "request_timeout_s": 120},
        "context_servers": {"tp": 1},
        "generation_servers": {"tp": 1, "executor": {"enable_block_reuse": False}},
    }


def config(tmp_path, name: str, d: dict) -> str:
    path = os.path.join(str(tmp_path), f"{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(d, f)
    return path


def launch(d: dict, log_dir: str) -> Cluster:
    """Start every worker and the router of config `d` (ports 0 become free ports); wait until healthy."""
    c = Cluster(parse_config(d), log_dir=log_dir, token=TOKEN)
    try:
        c.start()
        c.wait_healthy(240)
    except BaseException:
        c.stop()
        raise
    return c


def start_process(args: list[str], log_path: str, module: str = "kvbridge.cli") -> subprocess.Popen:
    """`kvbridge <args>` (or `python -m module <args>`, from the repository root) in its own process group,
    output to log_path."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(log_path, "w") as out:
        return subprocess.Popen([sys.executable, "-m", module, *args], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, **{TOKEN_ENV: TOKEN}),
                                cwd=root if module != "kvbridge.cli" else None)


def start_announced(args: list[str], log_path: str, timeout: float = 240, module: str = "kvbridge.cli",
                    scheme: str = "http") -> tuple[subprocess.Popen, str]:
    """`kvbridge worker|router <args> --port-file` whose config gives it port 0: (process, its base URL, of
    `scheme`: https when the config has tls) once it has bound its socket and announced the port (bounded;
    the process is stopped if it never does)."""
    port_file = log_path + ".port"
    p = start_process([*args, "--port-file", port_file], log_path, module)
    try:
        port = wait_port_file(port_file, timeout, p)
    except BaseException:
        stop_process(p)
        raise
    return p, f"{scheme}://127.0.0.1:{port}"


def stop_process(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait(5)


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout: float = 240) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {proc.returncode}")
        try:
            r = httpx.get(url + "/health", headers=HEADERS, timeout=2)
            if r.status_code == 200:
                return r.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} not healthy within {timeout}s")


def reference(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """What one aggregated executor answers, greedy (the tokens every disaggregated answer must equal)."""
    with Executor.start(ExecutorConfig(model=MODEL, num_blocks=128, tokens_per_block=8, timeout_s=120)) as ex:
        return ex.generate(prompts, max_tokens=max_tokens, timeout=120)


def sse_events(resp: httpx.Response) -> list[dict | str]:
    """Every `data:` event of a streamed response ('[DONE]' kept as a string)."""
    out: list[dict | str] = []
    for line in resp.iter_lines():
        if line.startswith("data:"):
            data = line[5:].strip()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def streamed_tokens(events: list[dict | str]) -> list[int]:
    return [t for e in events if isinstance(e, dict) and e.get("choices") for t in e["kvbridge"]["token_ids"]]


def free_blocks(url: str) -> list[int]:
    return httpx.get(url + "/debug/free_blocks", headers=HEADERS, timeout=60).json()["free_blocks"]


def wait_pool_full(url: str, num_blocks: int, world: int, timeout: float = 60) -> list[int]:
    """Poll a worker until every rank's pool is back to num_blocks (released KV is freed asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        got = free_blocks(url)
        if got == [num_blocks] * world or time.monotonic() > deadline:
            return got
        time.sleep(0.5)


def wait_log(path, pattern: str, proc: subprocess.Popen, timeout: float = 240,
             after: int = 0) -> re.Match:
    """The first match of `pattern` in the log at `path` past offset `after` (bounded; fails if serve died)"""
    deadline = time.monotonic() + timeout
    while True:
        text = path.read_text(errors="replace")[after:] if path.exists() else ""
        m = re.search(pattern, text)
        if m:
            return m
        assert proc.poll() is None, f"serve exited with {proc.returncode}:\n{text[-3000:]}"
        assert time.monotonic() < deadline, f"{pattern!r} not in the log within {timeout}s:\n{text[-3000:]}"
        time.sleep(0.2)


class Serve:
    """`kvbridge serve` of config `cfg` with the tests' token, in its own process group; the router's and the
    workers' urls read from what it prints."""

    def __init__(self, tmp_path, cfg: dict) -> None:
        self.log = tmp_path / "serve.log"
        with open(self.log, "w") as out:
            cmd = [sys.executable, "-m", "kvbridge.cli", "serve", config(tmp_path, "c", cfg)]
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         env=dict(os.environ, **{TOKEN_ENV: TOKEN}))
        self.router = wait_log(self.log, r"OpenAI API at (\S+)/v1", self.proc).group(1)
        ready = r"\[(\w+)\] \w+ worker ready at (http://[\d.]+:\d+)"
        self.urls = dict(re.findall(ready, self.log.read_text()))

    def pid(self, name: str) -> int:
        return httpx.get(self.urls[name] + "/health", headers=HEADERS, timeout=30).json()["pid"]

    def mark(self) -> int:
        return len(self.log.read_text(errors="replace"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(5)
