"""GPU check (session 19): what a one-host `kvbridge serve` deployment with CUDA executors listens on.

Context TP2 (NCCL between its ranks) and generation TP1 on the device machine's GPUs, NIXL between them, one
request through the router (exact against a one-GPU executor is not checked here: tests/serving do that); then
every TCP listener of the deployment's process groups, as JSON. Exits 1 if one is beyond loopback.
    python -m kvbridge.tests.gpu.one_host_listeners [--json out.json] [--cpu]
"""

from __future__ import annotations

import json
import os
import sys

import httpx

from kvbridge.serving.config import parse_config
from kvbridge.serving.launcher import Cluster
from kvbridge.tests.listeners import listening

CFG = {
    "model": "seeded:tiny3",
    "executor": {"num_blocks": 64, "tokens_per_block": 8, "device": "cuda", "timeout_s": 120},
    "transceiver": {"agent": "nixl", "handshake_timeout_s": 10},
    "router": {"port": 0, "request_timeout_s": 120},
    "context_servers": {"tp": 2, "device": "cuda:0"},
    "generation_servers": {"tp": 1, "device": "cuda:0"},
}


def main() -> int:
    out = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else None
    env = {k: os.environ.get(k) for k in ("UCX_NET_DEVICES", "NCCL_SOCKET_IFNAME")}
    cfg = CFG
    if "--cpu" in sys.argv:  # the same on CPU (gloo between the context ranks): to try the script anywhere
        cfg = {**CFG, "executor": {**CFG["executor"], "device": "cpu"}, "context_servers": {"tp": 2},
               "generation_servers": {"tp": 1}}
    with Cluster(parse_config(cfg)) as c:
        c.start()
        c.wait_healthy(300)
        r = httpx.post(c.router_url + "/v1/completions", json={"prompt": list(range(5, 40)), "max_tokens": 4,
                                                              "temperature": 0}, timeout=120)
        r.raise_for_status()
        groups = frozenset(os.getpgid(ch.proc.pid) for ch in c.children)
        addrs = sorted(listening(groups=groups))
    beyond = [f"{ip}:{port}" for ip, port in addrs if not ip.is_loopback]
    row = {"environment": env, "tokens": r.json()["kvbridge"]["token_ids"], "listeners": len(addrs),
           "beyond_loopback": beyond}
    print(json.dumps(row))
    if out:
        with open(out, "w") as f:
            json.dump(row, f, indent=1)
    return 1 if beyond else 0


if __name__ == "__main__":
    raise SystemExit(main())
