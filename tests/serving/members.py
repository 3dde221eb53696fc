"""A `disagg_cluster` deployment started by hand for the cluster tests: the router (port 0, announced), then
workers that join through the registry (`kvbridge worker --name N`), each in its own process group, with the
tests' token (cluster.start_process). Waits read the router's /health, bounded; `stop` ends every process."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
import yaml

from .cluster import MODEL, PATIENT, start_announced, start_process, stop_process

BLOCKS = 256


def cluster_config(uri: str | None, heartbeat_s: float = 1, ttl_s: float = 4, **cluster) -> dict:
    """A cluster config: tcp agent, positional KV digests on, the generation side pulling every prompt whole."""
    return {
        "model": MODEL,
        "executor": {"num_blocks": BLOCKS, "tokens_per_block": 8, "threads_per_rank": 1, "timeout_s": 120,
                     "kv_digests": True},
        "transceiver": {"agent": "tcp", "handshake_timeout_s": 3, **PATIENT},
        "router": {"port": 0, "request_timeout_s": 120, "health_interval_s": 1},
        "disagg_cluster": {**({"cluster_uri": uri} if uri else {}), "heartbeat_interval_sec": heartbeat_s,
                           "inactive_interval_sec": ttl_s, "drain_timeout_sec": 30, **cluster},
        "context_servers": {"tp": 1},
        "generation_servers": {"tp": 1, "executor": {"enable_block_reuse": False}},
    }


class Deployment:
    """The router of config `d`, and workers added by name. With an http:// registry (no cluster_uri in `d`),
    the workers' config names the router's announced port."""

    def __init__(self, tmp_path, d: dict, verify=True) -> None:
        """`verify`: this test's check of the router's certificate (a CA context when `d` has tls)."""
        self.tmp, self.verify = tmp_path, verify
        self.procs: dict[str, subprocess.Popen] = {}
        self.router_proc, self.router = start_announced(["router", "--config", self._write("router", d)],
                                                        str(tmp_path / "router.log"), timeout=120,
                                                        scheme="https" if d.get("tls") else "http")
        cl = dict(d["disagg_cluster"])
        cl.setdefault("cluster_uri", self.router)
        self.worker_config = self._write("worker", {**d, "disagg_cluster": cl})

    def _write(self, name: str, d: dict) -> str:
        path = str(self.tmp / f"{name}.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(d, f)
        return path

    def log(self, name: str) -> str:
        return str(self.tmp / f"{name}.log")

    def start_worker(self, role: str, name: str, tag: str | None = None) -> subprocess.Popen:
        """`kvbridge worker --name name`, its process and log kept under `tag` (default: the name)."""
        p = start_process(["worker", "--config", self.worker_config, "--role", role, "--name", name],
                          self.log(tag or name))
        self.procs[tag or name] = p
        return p

    def health(self) -> dict:
        return httpx.get(self.router + "/health", timeout=10, verify=self.verify).json()

    def members(self) -> dict:
        return self.health()["cluster"]["workers"]

    def wait(self, cond, what: str, timeout: float = 240) -> dict:
        """Poll the router's /health until cond(body) (a started worker that exits fails the wait)."""
        deadline = time.monotonic() + timeout
        while True:
            body = self.health()
            if cond(body):
                return body
            dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None and n not in
                    body["cluster"]["workers"] and p.returncode not in (0, -9)}
            assert not dead, f"{dead} exited while waiting for {what}: {self.tail(next(iter(dead)))}"
            assert time.monotonic() < deadline, f"{what}: not within {timeout}s; /health: {body}"
            time.sleep(0.1)

    def wait_healthy(self, *names: str, timeout: float = 240) -> dict:
        return self.wait(lambda b: all(b["cluster"]["workers"].get(n, {}).get("healthy") for n in names),
                         f"{names} registered and healthy", timeout)

    def url(self, name: str) -> str:
        return self.members()[name]["url"]

    def kill9(self, name: str) -> None:
        os.killpg(self.procs[name].pid, signal.SIGKILL)  # the worker and its rank processes, at once
        self.procs[name].wait(10)

    def router_log(self) -> str:
        """Every router log of this deployment (router.log, then router2.log ... of restarts)."""
        return "".join(p.read_text(errors="replace") for p in sorted(self.tmp.glob("router*.log")))

    def tail(self, name: str, n: int = 3000) -> str:
        with open(self.log(name), errors="replace") as f:
            return f.read()[-n:]

    def stop(self) -> None:
        for p in self.procs.values():
            stop_process(p)
        stop_process(self.router_proc)
