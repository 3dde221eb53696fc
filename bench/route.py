"""`kvbridge bench route [--quick] --json PATH [--png PATH]`: routing policies against the KV each worker holds.

Real workers on CPU (default 4 context + 2 generation, tcp agent, greedy), one fresh deployment per policy
(round_robin, least_loaded, prefix_aware, kv_aware), three workloads run in turn on it:

    chat            conversations x turns; each turn's prompt = the previous prompt + its answer + a new
                    user message (all conversations share a short system prompt); turns sent concurrently
    shared_system   many users behind a few long system prompts (together more than one context worker's
                    pool holds), interleaved, sent concurrently
    no_reuse        random prompts (the control: nothing to reuse)

kv_aware runs with `local_prefill_tokens: 32` (KV_AWARE; `--kv-aware default` for the router's defaults): a
request whose generation worker holds all but <= 32 of its prompt tokens skips the context hop.

Per (workload, policy): prefill tokens computed (the context workers' prompt tokens minus their prefix-cache
hits, from their /metrics, plus the tails generation workers prefilled themselves, from the answers),
`oracle_prefill_tokens` (what a router that knows every cache exactly would leave to compute: for each
request, its prompt minus the longest prefix any context worker holds when it is sent, or a generation
worker that holds all but a tail it may prefill itself, read from an index this client keeps of the
workers' own KV events),
KV bytes moved (each answer's transfer stats), TTFT p50/p90 (first streamed token), where the TTFT went
(`ttft_parts_p50_ms`, over the requests that took a context hop: before the prefill starts, the prefill,
after it until the first token, and the pull alone), requests/s, and `identical`: every answer equals
aggregated decoding of the same prompt (one aggregated executor, after the runs). Speed is measured, never
asserted. HTTP and the workers' KV events only: never reads worker internals. `--trace PATH` appends every
request's route and what each worker held of its prompt as it left (JSON lines; bench/route_trace.py counts
the requests that computed more than the oracle's by cause: docs/routing-cost.md).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from .common import machine, table, write_json
from .plot import save_plot
from .prefix import _pct

MODEL = "seeded:tiny3"
TPB = 8
ANSWER = 8
POLICIES = ("round_robin", "least_loaded", "prefix_aware", "kv_aware")
WORKLOADS = ("chat", "shared_system", "no_reuse")
PATIENT = {"transfer_timeout_s": 120, "peer_timeout_s": 300, "lease_s": 60, "heartbeat_s": 1}
FULL = {"ctx": 4, "gen": 2, "conversations": 32, "turns": 6, "systems": 8, "system_tokens": 384, "users": 64,
        "no_reuse": 64, "ctx_blocks": 224, "gen_blocks": 512, "threads": 8}
KV_AWARE = {"local_prefill_tokens": 32}  # kv_aware's settings here: a short tail is prefilled where it decodes
QUICK = {"ctx": 2, "gen": 1, "conversations": 4, "turns": 2, "systems": 3, "system_tokens": 96, "users": 9,
         "no_reuse": 4, "ctx_blocks": 40, "gen_blocks": 160, "threads": 4}


def _config(policy: str, p: dict, model: str, kv: dict | None = None) -> dict[str, Any]:
    router = {"port": 0, "policy": policy, "request_timeout_s": 600, "health_interval_s": 0.5}
    if kv and policy == "kv_aware":
        router["kv_aware"] = kv
    return {
        "model": model,
        "executor": {"num_blocks": p["ctx_blocks"], "tokens_per_block": TPB, "threads_per_rank": 1,
                     "timeout_s": 300, "enable_block_reuse": True, "kv_events": True},  # events: the oracle
        "transceiver": {"agent": "tcp", "handshake_timeout_s": 10, **PATIENT},
        "router": router,
        "context_servers": {"instances": p["ctx"], "tp": 1},
        "generation_servers": {"instances": p["gen"], "tp": 1, "executor": {"num_blocks": p["gen_blocks"]}},
    }


def _counters(url: str, token: str) -> dict[str, float]:
    """A context worker's prefix-cache counters (prompt tokens, reused tokens) from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    from ..serving.auth import TOKEN_HEADER

    out = {"prompt": 0.0, "reused": 0.0}
    text = httpx.get(url + "/metrics", headers={TOKEN_HEADER: token}, timeout=60).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "kvbridge_serving_prefix_tokens_total" and s.labels["kind"] in out:
                out[s.labels["kind"]] += s.value
    return out


def _toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 256) for _ in range(n)]


class _Oracle:
    """An index of every worker's cache from their own KV events (the router's code, in this client). The hit
    counts the context workers' caches; with `local` N > 0 the generation workers' too, under the deployment's
    own rule: a generation worker's cache counts for a request when it holds all but at most N of its tokens
    (it would prefill that tail)."""

    def __init__(self, cluster, local: int = 0) -> None:
        from ..executor.kv_events import derive_secret
        from ..serving.auth import TOKEN_HEADER
        from ..serving.kv_index import KvIndex
        from ..serving.kv_subscriber import KvEventsClient

        self.client = KvEventsClient(KvIndex(), derive_secret(cluster.token), replay_timeout_s=20)
        self.local = local
        self.gen = [s.name for s in cluster.cfg.generation]  # followed always: --trace shows what they hold
        servers = list(cluster.cfg.context) + list(cluster.cfg.generation)
        self.names = [s.name for s in servers]
        for s in servers:
            h = httpx.get(s.url + "/health", headers={TOKEN_HEADER: cluster.token}, timeout=60).json()
            self.client.sync_worker(s.name, h["kv_events"])
        deadline = time.monotonic() + 120
        while not all(self.client.synced(n) for n in self.names):
            if time.monotonic() > deadline:
                raise RuntimeError("the oracle's index never synced with the workers")
            time.sleep(0.1)

    def held(self, prompt: list[int]) -> dict[str, int]:
        """Prompt tokens each worker holds now (at most all but the last token)."""
        cache: dict = {}
        cap = (len(prompt) - 1) // TPB * TPB
        return {n: min(cap, TPB * self.client.index.match(n, self.client.index.keys_for(n, prompt, cache))[0])
                for n in self.names}

    def hit(self, prompt: list[int], held: dict[str, int]) -> int:
        """Prompt tokens the best-placed worker holds (`held`: from held())."""
        return max(h for n, h in held.items()
                   if n not in self.gen or (self.local and h and len(prompt) - h <= self.local))

    def close(self) -> None:
        self.client.close()


def _waves(workload: str, p: dict, seed: int):
    """Yield lists of prompts sent concurrently; a chat wave's prompts depend on the previous answers, which
    the caller sends back into the generator."""
    rng = random.Random(seed)
    if workload == "chat":
        system = _toks(rng, 64)
        prompts = [system + _toks(rng, 12) for _ in range(p["conversations"])]
        for _ in range(p["turns"]):
            answers = yield prompts
            prompts = [pr + a + _toks(rng, 12) for pr, a in zip(prompts, answers)]
    elif workload == "shared_system":
        systems = [_toks(rng, p["system_tokens"]) for _ in range(p["systems"])]
        reqs = [systems[rng.randrange(len(systems))] + _toks(rng, 24) for _ in range(p["users"])]
        for i in range(0, len(reqs), p["threads"]):
            yield reqs[i:i + p["threads"]]
    else:
        reqs = [_toks(rng, rng.randrange(64, 160)) for _ in range(p["no_reuse"])]
        for i in range(0, len(reqs), p["threads"]):
            yield reqs[i:i + p["threads"]]


def run_policy(policy: str, p: dict, model: str, seed: int, workloads=WORKLOADS,
               kv: dict | None = None) -> dict[str, dict[str, Any]]:
    from ..serving.config import parse_config
    from ..serving.launcher import Cluster

    cluster = Cluster(parse_config(_config(policy, p, model, kv)), log_dir=tempfile.mkdtemp(prefix="kvb-route-"))
    out: dict[str, dict[str, Any]] = {}
    try:
        cluster.start()
        cluster.wait_healthy(600)
        oracle = _Oracle(cluster, int((kv or {}).get("local_prefill_tokens", 0)) if policy == "kv_aware" else 0)
        try:
            with httpx.Client() as client, ThreadPoolExecutor(p["threads"]) as pool:
                for wl in workloads:
                    out[wl] = _run_workload(wl, p, seed, cluster, client, pool, oracle)
                    print(f"[bench route] {policy:>13} {wl:>13}: prefill {out[wl]['prefill_tokens']} (oracle "
                          f"{out[wl]['oracle_prefill_tokens']}), ttft p50 {out[wl]['ttft_p50_ms']} ms "
                          f"{out[wl]['ttft_parts_p50_ms']}", flush=True)
        finally:
            oracle.close()
    finally:
        cluster.stop()
    return out


def _run_workload(wl: str, p: dict, seed: int, cluster, client, pool, oracle: _Oracle) -> dict[str, Any]:
    before = [_counters(s.url, cluster.token) for s in cluster.cfg.context]
    ttfts, moved, oracle_prefill, sent, answers, parts, local, local_prompt = [], 0, 0, [], [], [], 0, 0
    trace: list[dict[str, Any]] = []  # per request: the route and what each worker held as it left
    t0 = time.monotonic()
    gen = _waves(wl, p, seed)
    wave, n_wave = next(gen), 0
    while True:
        got = list(pool.map(lambda pr: _ask_with_oracle(client, cluster.router_url, pr, oracle), wave))
        for i, (pr, g) in enumerate(zip(wave, got)):
            trace.append({"wave": n_wave, "i": i, "prompt_tokens": len(pr),
                          "oracle_hit": g["oracle_hit"], "oracle_held": g["oracle_held"], **g["trace"]})
            oracle_prefill += len(pr) - g["oracle_hit"]
            ttfts.append(g["ttft_s"])
            parts.append(g["parts"])
            local += g["local_prefill_tokens"]
            local_prompt += g["local_prompt_tokens"]
            moved += g["bytes"]
            sent.append(pr)
            answers.append(g["tokens"])
        n_wave += 1
        try:
            wave = gen.send([g["tokens"] for g in got])
        except StopIteration:
            break
    wall = time.monotonic() - t0
    after = [_counters(s.url, cluster.token) for s in cluster.cfg.context]
    prompt = sum(a["prompt"] - b["prompt"] for a, b in zip(after, before))
    reused = sum(a["reused"] - b["reused"] for a, b in zip(after, before))
    # a request whose tail the generation worker prefilled itself (local_prefill_tokens) counts there
    return {"prompt_tokens": int(prompt + local_prompt), "prefill_tokens": int(prompt - reused + local),
            "local_prefill_tokens": local,
            "oracle_prefill_tokens": int(oracle_prefill), "kv_bytes_moved": moved,
            "ttft_p50_ms": round(_pct(ttfts, 0.5) * 1e3, 1), "ttft_p90_ms": round(_pct(ttfts, 0.9) * 1e3, 1),
            "req_per_s": round(len(ttfts) / wall, 2), "requests": len(ttfts),
            "ttft_parts_p50_ms": {k: round(_pct([x[k] for x in parts if k in x], 0.5), 1)
                                  for k in ("to_prefill", "prefill", "after_prefill", "transfer")},
            "local_prefill_requests": sum(1 for x in parts if "local_prefill" in x),
            "_sent": sent, "_answers": answers, "_trace": trace}


def _ask_with_oracle(client, url: str, prompt: list[int], oracle: _Oracle) -> dict[str, Any]:
    """What the best-placed context worker holds of `prompt` just before it is sent (the index first takes
    every event published so far), then the request."""
    oracle.client.barrier(60)
    held = oracle.held(prompt)
    return {**_ask(client, url, prompt), "oracle_hit": oracle.hit(prompt, held), "oracle_held": held}


def _ask(client, url: str, prompt: list[int]) -> dict[str, Any]:
    """One streamed completion: its tokens, TTFT, the bytes moved, and where the TTFT went (`parts`, ms: the
    router decorates the final event with the prefill's timestamps; before the prefill starts = the router's
    pick, the hops and the context worker's queue; the prefill; after it = the rest until the first token
    reached this client, the pull included; and the pull alone)."""
    body = {"prompt": prompt, "max_tokens": ANSWER, "temperature": 0, "stream": True}
    t0, u0 = time.monotonic(), time.time() * 1e3
    ttft, tokens, moved, parts, local, local_prompt, final = None, [], 0, {}, 0, 0, {}
    with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            ev = json.loads(line[5:])
            if "error" in ev:
                raise RuntimeError(f"stream error: {ev['error']}")
            kb = ev.get("kvbridge") or {}
            if kb.get("token_ids") and ttft is None:
                ttft = time.monotonic() - t0
            if "prefill_end_unix_ms" in kb or "route" in kb:  # the final event
                parts, final = _parts(kb, u0, u0 + (ttft or 0.0) * 1e3), kb
                if (kb.get("route") or {}).get("local_prefill"):  # the generation worker computed the tail
                    local, local_prompt = len(prompt) - int(kb.get("reused_tokens", 0)), len(prompt)
            tokens += kb.get("token_ids", [])
            moved += int((kb.get("transfer") or {}).get("bytes", 0))
    return {"tokens": tokens, "ttft_s": ttft or (time.monotonic() - t0), "bytes": moved, "parts": parts,
            "local_prefill_tokens": local, "local_prompt_tokens": local_prompt,
            "trace": {k: final[k] for k in ("route", "context_worker", "context_reused_tokens", "reused_tokens")
                      if k in final}}


def _parts(kb: dict, sent: float, first: float) -> dict[str, float]:
    start, end = kb.get("prefill_start_unix_ms"), kb.get("prefill_end_unix_ms")
    if not isinstance(start, (int, float)) or not isinstance(end, (int, float)):
        return {"local_prefill": 1.0} if (kb.get("route") or {}).get("local_prefill") else {}
    total = ((kb.get("transfer") or {}).get("ms") or {}).get("total")  # the pull, submitted to done
    return {"to_prefill": start - sent, "prefill": end - start, "after_prefill": first - end,
            **({"transfer": float(total)} if isinstance(total, (int, float)) else {})}


def _reference(model: str, prompts: list[list[int]]) -> dict[tuple[int, ...], list[int]]:
    from ..executor.runtime import Executor, ExecutorConfig

    uniq = list(dict.fromkeys(tuple(pr) for pr in prompts))
    with Executor.start(ExecutorConfig(model=model, num_blocks=2048, tokens_per_block=TPB, timeout_s=600)) as ex:
        got = []
        for i in range(0, len(uniq), 32):
            got += ex.generate([list(u) for u in uniq[i:i + 32]], max_tokens=ANSWER, timeout=600)
    return dict(zip(uniq, got))


def _png(path: str, rows: list[dict[str, Any]], title: str) -> None:
    keys = [("prefill_tokens", "prefill tokens computed"), ("kv_bytes_moved", "KV bytes moved"),
            ("ttft_p50_ms", "TTFT p50 (ms)"), ("ttft_p90_ms", "TTFT p90 (ms)"), ("req_per_s", "requests/s")]
    pols = list(dict.fromkeys(r["policy"] for r in rows))
    colors = {"round_robin": "#999999", "least_loaded": "#6baed6", "prefix_aware": "#fd8d3c", "kv_aware": "#2a7ab9"}

    def draw(fig) -> None:
        axes = fig.subplots(1, len(keys))
        for ax, (k, t) in zip(axes, keys):
            for j, pol in enumerate(pols):
                xs = [i + j / (len(pols) + 1) for i in range(len(WORKLOADS))]
                ys = [next((r[k] for r in rows if r["policy"] == pol and r["workload"] == wl), 0) for wl in WORKLOADS]
                ax.bar(xs, ys, width=1 / (len(pols) + 1), color=colors.get(pol), label=pol)
            if k == "prefill_tokens":
                for i, wl in enumerate(WORKLOADS):
                    o = next((r["oracle_prefill_tokens"] for r in rows if r["policy"] == "kv_aware"
                              and r["workload"] == wl), None)
                    if o is not None:
                        ax.hlines(o, i - 0.1, i + 0.9, colors="k", linestyles="dashed")
            ax.set_xticks([i + 0.35 for i in range(len(WORKLOADS))], WORKLOADS, fontsize=7)
            ax.set_title(t, fontsize=9)
        axes[0].legend(fontsize=7)

    save_plot(path, draw, title, size=(17, 3.6))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvbridge bench route", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 context + 1 generation workers, tiny workloads, "
                                                         "round_robin and kv_aware only")
    ap.add_argument("--policies", default=None, help="comma-separated (default: all four; --quick: 2)")
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--workloads", default=None, help=f"comma-separated (default: {','.join(WORKLOADS)})")
    ap.add_argument("--kv-aware", default=",".join(f"{k}={v}" for k, v in KV_AWARE.items()), metavar="K=V,...",
                    help="router.kv_aware settings of the kv_aware deployment (default: %(default)s; "
                         "'default': the router's own defaults)")
    ap.add_argument("--seed", type=int, default=26)
    ap.add_argument("--json", default=None)
    ap.add_argument("--merge", action="store_true", help="keep the other policies' rows already in --json")
    ap.add_argument("--png", default=None, help="default: the --json path with .png")
    ap.add_argument("--trace", default=None, metavar="PATH", help="write every request's route, and what each "
                    "worker held as it left (the oracle's index), as JSON lines (bench/route_trace.py reads it)")
    a = ap.parse_args(argv)
    p = dict(QUICK if a.quick else FULL)
    pols = a.policies.split(",") if a.policies else (["round_robin", "kv_aware"] if a.quick else list(POLICIES))
    wls = a.workloads.split(",") if a.workloads else list(WORKLOADS)
    bad = [w for w in wls if w not in WORKLOADS]
    if bad:
        ap.error(f"--workloads: unknown {bad} (known: {', '.join(WORKLOADS)})")
    kv = None if a.kv_aware in ("", "default") else \
        {k: float(v) for k, v in (x.split("=", 1) for x in a.kv_aware.split(","))}
    rows: list[dict[str, Any]] = []
    for pol in pols:
        print(f"[bench route] {pol}: {p['ctx']}+{p['gen']} workers ...", flush=True)
        for wl, r in run_policy(pol, p, a.model, a.seed, wls, kv).items():
            _write_trace(a.trace, [{"workload": wl, "policy": pol, **t} for t in r.pop("_trace")])
            rows.append({"workload": wl, "policy": pol, **r, **({"kv_aware": kv} if kv and pol == "kv_aware" else {})})
    ref = _reference(a.model, [pr for r in rows for pr in r["_sent"]])
    for r in rows:
        r["identical"] = all(ref[tuple(pr)] == ans for pr, ans in zip(r.pop("_sent"), r.pop("_answers")))
    if a.merge and a.json and os.path.exists(a.json):
        with open(a.json) as f:
            rows = [r for r in json.load(f)["rows"] if r["policy"] not in pols or r["workload"] not in wls] + rows
        rows.sort(key=lambda r: (WORKLOADS.index(r["workload"]), POLICIES.index(r["policy"])))
    cols = ["workload", "policy", "prompt_tokens", "prefill_tokens", "oracle_prefill_tokens", "kv_bytes_moved",
            "ttft_p50_ms", "ttft_p90_ms", "req_per_s", "identical"]
    print(table(rows, cols))
    goals = _goals(rows)
    print(f"goals: {goals}")
    write_json(a.json, {"rows": rows, "goals": goals, "params": p, "model": a.model, "machine": machine(),
                        "tokens_per_block": TPB, "answer_tokens": ANSWER})
    png = a.png or (a.json[:-5] + ".png" if a.json and a.json.endswith(".json") else None)
    if png:
        _png(png, rows, f"kvbridge bench route: {p['ctx']} context + {p['gen']} generation workers ({a.model}, "
                        f"CPU); dashed: the oracle's prefill tokens")
    return 0 if all(r["identical"] for r in rows) else 1


def _write_trace(path: str | None, rows: list[dict[str, Any]]) -> None:
    if path:
        with open(path, "a") as f:
            f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in rows)


def _goals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def get(wl, pol, k):
        return next((r[k] for r in rows if r["workload"] == wl and r["policy"] == pol), None)

    out: dict[str, Any] = {}
    for wl in ("chat", "shared_system"):
        kv, orc = get(wl, "kv_aware", "prefill_tokens"), get(wl, "kv_aware", "oracle_prefill_tokens")
        if kv is not None:
            out[f"{wl}_prefill_vs_oracle"] = round(kv / max(1, orc), 3)
            out[f"{wl}_within_5pct_of_oracle"] = kv <= 1.05 * orc
    rr, kv = get("shared_system", "round_robin", "ttft_p50_ms"), get("shared_system", "kv_aware", "ttft_p50_ms")
    if rr and kv:
        out["shared_system_ttft_p50_speedup_vs_round_robin"] = round(rr / kv, 2)
    ll, kv = get("no_reuse", "least_loaded", "ttft_p50_ms"), get("no_reuse", "kv_aware", "ttft_p50_ms")
    if ll and kv:
        out["no_reuse_ttft_p50_vs_least_loaded"] = round(kv / ll, 2)
    return out
