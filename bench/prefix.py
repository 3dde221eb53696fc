"""`kvbridge bench prefix [--quick] --json PATH [--png PATH]`: multi-turn chat through the router, block reuse
on (prefix_aware routing) vs off (round_robin), the same conversations, greedy.

Owns the client side: conversations sharing a system prompt, each turn's prompt = the previous prompt + the
model's answer + a new user message (token ids), the turns of all conversations sent concurrently, turn by
turn. Measures per mode: prefill tokens computed by the context workers (prompt tokens minus those their
prefix caches served, from each worker's /metrics), KV bytes moved by the transceiver (each response's
transfer stats), TTFT p50/p95 (first streamed token), and whether every answer is identical between the modes.
Never reads worker internals: HTTP only. Speed here is measured, never asserted.
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

from .common import machine, table, write_json
from .plot import save_plot

MODEL = "seeded:tiny3"
SYSTEM_TOKENS = 64
USER_TOKENS = 12
ANSWER_TOKENS = 8
TPB = 8
PATIENT = {"transfer_timeout_s": 120, "peer_timeout_s": 300, "lease_s": 60, "heartbeat_s": 1}


def _config(reuse: bool, workers: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "executor": {"num_blocks": 1024, "tokens_per_block": TPB, "threads_per_rank": 1, "timeout_s": 300,
                     "enable_block_reuse": reuse},
        "transceiver": {"agent": "nixl", "handshake_timeout_s": 10, **PATIENT},
        "router": {"port": 0, "policy": "prefix_aware" if reuse else "round_robin", "request_timeout_s": 600},
        "context_servers": {"instances": workers, "tp": 1},
        "generation_servers": {"instances": workers, "tp": 1},
    }


def _users(conversations: int, turns: int, seed: int = 7) -> tuple[list[int], list[list[list[int]]]]:
    rng = random.Random(seed)
    system = [rng.randrange(1, 256) for _ in range(SYSTEM_TOKENS)]
    users = [[[rng.randrange(1, 256) for _ in range(USER_TOKENS)] for _ in range(turns)]
             for _ in range(conversations)]
    return system, users


def _ask(client: httpx.Client, url: str, prompt: list[int]) -> dict[str, Any]:
    """One streamed completion: its tokens, TTFT, and the transfer's bytes."""
    body = {"prompt": prompt, "max_tokens": ANSWER_TOKENS, "temperature": 0, "stream": True}
    t0 = time.monotonic()
    ttft, tokens, moved, reused = None, [], 0, 0
    with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            ev = json.loads(line[5:])
            kb = ev.get("kvbridge") or {}
            if "error" in ev:
                raise RuntimeError(f"stream error: {ev['error']}")
            if kb.get("token_ids") and ttft is None:
                ttft = time.monotonic() - t0
            tokens += kb.get("token_ids", [])
            moved += int((kb.get("transfer") or {}).get("bytes", 0))
            reused = int(kb.get("reused_tokens", reused))
    return {"tokens": tokens, "ttft_s": ttft or (time.monotonic() - t0), "bytes": moved, "gen_reused": reused}


def _prefix_counters(url: str, headers: dict[str, str]) -> dict[str, float]:
    """A worker's prefix counters from its /metrics (the deployment's internal token: closed by default)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {"prompt": 0.0, "reused": 0.0, "bytes_saved": 0.0}
    r = httpx.get(url + "/metrics", headers=headers, timeout=60)
    if r.status_code != 200:
        raise RuntimeError(f"{url}/metrics answered {r.status_code}: {r.text[:200]}")
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            if s.name == "kvbridge_serving_prefix_tokens_total":
                out[s.labels["kind"]] += s.value
            elif s.name == "kvbridge_serving_prefix_bytes_saved_total":
                out["bytes_saved"] += s.value
    return out


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else 0.0


def run_mode(reuse: bool, conversations: int, turns: int, workers: int, threads: int) -> dict[str, Any]:
    from ..serving.config import parse_config
    from ..serving.launcher import Cluster

    system, users = _users(conversations, turns)
    cluster = Cluster(parse_config(_config(reuse, workers)), log_dir=tempfile.mkdtemp(prefix="kvb-prefix-"))
    try:
        cluster.start()
        cluster.wait_healthy(300)
        prompts = [list(system) for _ in range(conversations)]
        answers: list[list[list[int]]] = [[] for _ in range(conversations)]
        ttfts, moved, gen_reused, prompt_tokens = [], 0, 0, 0
        t0 = time.monotonic()
        with httpx.Client() as client, ThreadPoolExecutor(threads) as pool:
            for t in range(turns):
                for c in range(conversations):
                    prompts[c] = prompts[c] + users[c][t]
                    prompt_tokens += len(prompts[c])
                got = list(pool.map(lambda c: _ask(client, cluster.router_url, prompts[c]),
                                    range(conversations)))
                for c, g in enumerate(got):
                    answers[c].append(g["tokens"])
                    prompts[c] = prompts[c] + g["tokens"]
                    ttfts.append(g["ttft_s"])
                    moved += g["bytes"]
                    gen_reused += g["gen_reused"]
        wall = time.monotonic() - t0
        ctx = [_prefix_counters(s.url, cluster.headers) for s in cluster.cfg.context]
    finally:
        cluster.stop()
    ctx_reused = sum(x["reused"] for x in ctx)
    return {"prompt_tokens": prompt_tokens, "prefill_tokens": int(prompt_tokens - ctx_reused),
            "ctx_reused_tokens": int(ctx_reused), "gen_reused_tokens": gen_reused, "bytes_moved": moved,
            "ttft_p50_ms": round(_pct(ttfts, 0.5) * 1e3, 1), "ttft_p95_ms": round(_pct(ttfts, 0.95) * 1e3, 1),
            "wall_s": round(wall, 1), "requests": len(ttfts), "answers": answers,
            "policy": "prefix_aware" if reuse else "round_robin", "workers": {"context": workers,
                                                                              "generation": workers}}


def _png(path: str, res: dict[str, Any]) -> None:
    keys = [("prefill_tokens", "prefill tokens computed"), ("bytes_moved", "KV bytes moved"),
            ("ttft_p50_ms", "TTFT p50 (ms)"), ("ttft_p95_ms", "TTFT p95 (ms)")]

    def draw(fig) -> None:
        for ax, (k, title) in zip(fig.subplots(1, len(keys)), keys):
            vals = [res["no_reuse"][k], res["reuse"][k]]
            ax.bar(["no reuse", "reuse"], vals, color=["#999999", "#2a7ab9"])
            ax.set_title(title, fontsize=10)
            for i, v in enumerate(vals):
                ax.text(i, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=8)

    save_plot(path, draw, f"kvbridge prefix reuse: {res['conversations']} conversations x {res['turns']} "
                          f"turns ({MODEL}, CPU, through the router); identical outputs: {res['identical']}",
              size=(14, 3.4))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvbridge bench prefix", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 conversations x 3 turns, one worker per role")
    ap.add_argument("--conversations", type=int, default=None)
    ap.add_argument("--turns", type=int, default=None)
    ap.add_argument("--workers", type=int, default=None, help="context and generation workers each")
    ap.add_argument("--threads", type=int, default=8, help="client requests in flight")
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None, help="default: the --json path with .png")
    a = ap.parse_args(argv)
    conv = a.conversations or (8 if a.quick else 32)
    turns = a.turns or (3 if a.quick else 6)
    workers = a.workers or (1 if a.quick else 2)
    res: dict[str, Any] = {"conversations": conv, "turns": turns, "model": MODEL, "machine": machine(),
                           "system_tokens": SYSTEM_TOKENS, "user_tokens": USER_TOKENS,
                           "answer_tokens": ANSWER_TOKENS, "tokens_per_block": TPB}
    for name, reuse in (("no_reuse", False), ("reuse", True)):
        print(f"[bench prefix] {name}: {conv} conversations x {turns} turns, {workers}+{workers} workers ...",
              flush=True)
        res[name] = run_mode(reuse, conv, turns, workers, a.threads)
    res["identical"] = res["reuse"]["answers"] == res["no_reuse"]["answers"]
    for name in ("reuse", "no_reuse"):
        res[name].pop("answers")
    r, n = res["reuse"], res["no_reuse"]
    res["ratios"] = {"prefill_tokens": round(r["prefill_tokens"] / max(1, n["prefill_tokens"]), 4),
                     "bytes_moved": round(r["bytes_moved"] / max(1, n["bytes_moved"]), 4)}
    res["goal_met"] = res["identical"] and res["ratios"]["bytes_moved"] <= 0.30 and \
        res["ratios"]["prefill_tokens"] <= 0.35
    rows = [{"mode": k, **{c: res[k][c] for c in ("prompt_tokens", "prefill_tokens", "bytes_moved",
                                                    "ttft_p50_ms", "ttft_p95_ms", "wall_s")}}
            for k in ("no_reuse", "reuse")]
    print(table(rows, ["mode", "prompt_tokens", "prefill_tokens", "bytes_moved", "ttft_p50_ms", "ttft_p95_ms",
                       "wall_s"]))
    print(f"ratios (reuse / no reuse): {res['ratios']}; identical outputs: {res['identical']}; "
          f"goal met: {res['goal_met']}")
    write_json(a.json, res)  # (a dict, not rows: the brief's shape)
    png = a.png or (a.json[:-5] + ".png" if a.json and a.json.endswith(".json") else None)
    if png:
        _png(png, res)
    return 0 if res["identical"] else 1
