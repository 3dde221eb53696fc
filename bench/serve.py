"""`kvbridge bench serve [--quick] [--json PATH] [--png PATH]`: time to first token through the real router and
workers, aggregated vs disaggregated, with the KV transfer overlapped with the prefill (router.overlap) or not.

On GPUs (the default without --quick): a seeded model with Llama-3.1-8B's shape (32 layers, 32 heads, 8 kv
heads, head_dim 128, bf16), the context executor on GPU 1, generation on GPU 0, prompts of 1k/4k/8k tokens
(`--prompts ...,16384` asks for 16k: the reference engine's unchunked attention needs a 32 GiB score tensor
there, more than an 80 GB GPU holds beside the weights and pools). Phase A (matching layouts, TP1 -> TP1): one context worker and one generation worker per agent
(cuda_ipc, nixl direct, nixl staged), each behind two routers (overlap off / on). Phase B (hetero, 8k):
context TP1 -> generation TP2 and context TP2 -> generation TP1, one side sharing a GPU so KV crosses NVLink.
Phase C (8k): NIXL with UCX forced to TCP (UCX_TLS=tcp,..., 1 MiB segments on every worker: docs/nixl-tcp.md),
standing for another host, streaming every layer (`--tcp-stream-layers`): reads straight from GPU memory
("direct") and staged through pinned host memory, packed layer group by layer group during the prefill
("staged-host": transceiver.staging_memory host, a 1 GiB arena each side). Then ITL and
requests/s at a fixed concurrency: disaggregated (through the router, overlap on) vs aggregated (requests
spread over both GPUs' workers, each running them whole). `--quick`: the same on CPU with a tiny model, the
tcp agent and short prompts (seconds; for `make test`); phase C there only when named (`--phases C`: host
pools, so it checks the rows' plumbing and exact tokens, not the GPU-over-TCP cost).

Per row: {prompt_tokens, agent, path, streaming, prefill_ms, ttft_agg_ms, ttft_disagg_ms, exposed_ms,
exposed_pct}. prefill_ms is the context worker's own (submit -> prefill done); exposed_ms = the generation
worker's first decode step started (KV in and first token joined, its engine's clock) minus the context's
prefill step ended (its engine's clock): one host, one clock. TTFT is the client's, first streamed token.
Medians of `--repeat` requests after one warm-up. Every answer's tokens are compared with the aggregated
ones (`exact`). Speed is measured, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from .common import machine, table, write_json
from .serve_plot import png as _png

LLAMA8B = "seeded:small,layers=32,hidden=4096,heads=32,kv_heads=8,head_dim=128,ffn=14336,vocab=128256," \
          "max_position=17408"
QUICK_MODEL = "seeded:tiny3,layers=8,hidden=384,ffn=768"
PATIENT = {"transfer_timeout_s": 120, "peer_timeout_s": 300, "lease_s": 60, "heartbeat_s": 1,
           "handshake_timeout_s": 30}
STAGING = {"staging_arena_bytes": 1 << 30}
UCX_TCP = {"UCX_TLS": "tcp,cuda_copy,self", "UCX_NET_DEVICES": "lo",  # docs/nixl-tcp.md: alike on every worker
           "UCX_TCP_TX_SEG_SIZE": "1M", "UCX_TCP_RX_SEG_SIZE": "1M", "UCX_TCP_SNDBUF": "8M", "UCX_TCP_RCVBUF": "8M"}
HOST_STAGING = {"staging_arena_bytes": (1 << 30) + (64 << 20), "staging_memory": "host"}  # phase C, issue 24


class _Skip(Exception):
    """A phase left out (--phases)."""


def _server(tp: int, device: str, agent: str, extra: dict | None = None, stream: int = 4) -> dict:
    tr = {"agent": agent, **(extra or {})}
    ex = {"device": device, "stream_layers": stream} if device else {"stream_layers": stream}
    return {"tp": tp, "executor": ex, "transceiver": tr}


def _config(model: str, ctx: dict, gens: list[dict], quick: bool, blocks: int, tpb: int) -> dict:
    ex = {"num_blocks": blocks, "tokens_per_block": tpb, "threads_per_rank": 1 if quick else 4,
          "timeout_s": 600, "max_batch_tokens": 17408, "enable_block_reuse": False}
    if not quick:
        ex["device"] = "cuda:0"
    return {"model": model, "executor": ex, "transceiver": dict(PATIENT), "startup_timeout_s": 900,
            "router": {"port": 0, "request_timeout_s": 600, "context_timeout_s": 600, "overlap": True},
            "context_servers": {"instances": 1, **ctx},
            "generation_servers": {"instances": 1, **gens[0]}}


class Deployment:
    """One config's workers (kvbridge serve's Cluster) and one router per (generation worker, overlap)."""

    def __init__(self, d: dict, extra_gens: list[dict] | None = None, env: dict | None = None) -> None:
        from ..serving.config import parse_config
        from ..serving.launcher import Cluster

        self.d, self.env = d, dict(env or {})
        old = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        self.logs = tempfile.mkdtemp(prefix="kvb-bench-serve-")
        self.cluster = Cluster(parse_config(d), log_dir=self.logs)
        self.procs: list[subprocess.Popen] = []
        self.routers: dict[tuple[int, bool], str] = {}
        try:
            self.cluster.start()
            # generation workers with another transceiver config (a group has one): started by hand, with the
            # deployment's CurveZMQ keys for generation workers (else the context rank refuses their hello)
            keys = {k: v for k, v in (self.cluster.cfg.raw["generation_servers"].get("transceiver") or {}).items()
                    if k.startswith("curve_")}
            pending = [self._spawn(["worker", "--role", "generation", "--index", "0"],
                                   {**d, "generation_servers": {**g, "transceiver": {**g.get("transceiver", {}),
                                                                                     **keys}}},
                                   f"gen-extra{i}") for i, g in enumerate(extra_gens or [])]
            self.cluster.wait_healthy(900)
            self.gens = [(s.url, d["generation_servers"]) for s in self.cluster.cfg.generation]
            self.gens += [(self._port(p, path), g) for (p, path), g in zip(pending, extra_gens or [])]
            for url, _g in self.gens:
                _wait(url + "/health", {}, 900)
        except BaseException:
            print(self.tails(), file=sys.stderr)
            self.stop()
            raise
        finally:
            for k, v in old.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)

    def _spawn(self, args: list[str], raw: dict, name: str) -> tuple[subprocess.Popen, str]:
        import yaml

        from ..serving.auth import TOKEN_ENV

        path = os.path.join(self.logs, name)
        with open(path + ".yaml", "w") as f:
            yaml.safe_dump(raw, f)
        with open(path + ".log", "w") as out:
            p = subprocess.Popen([sys.executable, "-m", "kvbridge.cli", *args, "--config", path + ".yaml",
                                  "--port-file", path + ".port"], stdout=out, stderr=subprocess.STDOUT,
                                 env=dict(os.environ, **{TOKEN_ENV: self.cluster.token}), start_new_session=True)
        self.procs.append(p)
        return p, path

    @staticmethod
    def _port(p: subprocess.Popen, path: str) -> str:
        from ..serving.listen import wait_port_file

        return f"http://127.0.0.1:{wait_port_file(path + '.port', 900, p)}"

    def tails(self) -> str:
        out = []
        for f in sorted(os.listdir(self.logs)):
            with open(os.path.join(self.logs, f), errors="replace") as fh:
                out.append(f"--- {f}\n" + "".join(fh.readlines()[-15:]))
        return "\n".join(out)

    def router(self, gen: int, overlap: bool) -> str:
        """The URL of a router sending to generation worker `gen` alone, overlap on or off."""
        if (gen, overlap) not in self.routers:
            url, group = self.gens[gen]
            raw = json.loads(json.dumps(self.d))
            raw["context_servers"] = {**raw["context_servers"],
                                      "urls": [s.url.removeprefix("http://") for s in self.cluster.cfg.context]}
            raw["generation_servers"] = {**group, "urls": [url.removeprefix("http://")]}
            raw["router"] = {**raw["router"], "overlap": overlap}
            p, path = self._spawn(["router"], raw, f"router-{gen}-{int(overlap)}")
            self.routers[(gen, overlap)] = self._port(p, path)
            _wait(self.routers[(gen, overlap)] + "/health", {})
        return self.routers[(gen, overlap)]

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        self.cluster.stop()


def _wait(url: str, headers: dict, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, headers=headers, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy within {timeout}s")


def ask(url: str, prompt: list[int], max_tokens: int, headers: dict | None = None) -> dict[str, Any]:
    """One streamed greedy completion: tokens, TTFT (client), chunk times, the kvbridge fields of the end."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    t0 = time.monotonic()
    times, tokens, last = [], [], {}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers or {}, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            ev = json.loads(line[5:])
            if "error" in ev:
                raise RuntimeError(f"{url}: stream error: {ev['error']}")
            kb = ev.get("kvbridge") or {}
            if kb.get("token_ids"):
                times.extend([time.monotonic() - t0] * len(kb["token_ids"]))
                tokens += kb["token_ids"]
            last.update(kb)
    return {"tokens": tokens, "ttft_ms": times[0] * 1e3, "times": times, "kb": last}


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    return [(i * 7919 + seed * 104729) % (vocab - 3) + 3 for i in range(n)]


def _med(xs: list[float]) -> float:
    return round(statistics.median(xs), 3) if xs else float("nan")


def measure(dep: Deployment, gen: int, n: int, repeat: int, vocab: int, agent: str, path: str, layout: str,
            agg_url: str, agg_cache: dict) -> list[dict]:
    """Rows (overlap off, on) for one prompt length through generation worker `gen`."""
    prompt = _prompt(n, vocab, n)
    if n not in agg_cache:  # the aggregated reference: the context worker running the request whole
        ask(agg_url, prompt, 2, dep.cluster.headers)
        runs = [ask(agg_url, prompt, 2, dep.cluster.headers) for _ in range(repeat)]
        agg_cache[n] = (_med([r["ttft_ms"] for r in runs]), runs[0]["tokens"])
    ttft_agg, want = agg_cache[n]
    rows = []
    for overlap in (False, True):
        url = dep.router(gen, overlap)
        ask(url, prompt, 2)  # warm-up (handshakes, first allocation)
        runs = [ask(url, prompt, 2) for _ in range(repeat)]
        kbs = [r["kb"] for r in runs]
        exposed = [kb["decode_start_unix_ms"] - kb["prefill_end_unix_ms"] for kb in kbs]
        prefill = _med([kb["prefill_ms"] for kb in kbs])
        ex = _med(exposed)
        rows.append({"prompt_tokens": n, "agent": agent, "path": path, "layout": layout, "streaming": overlap,
                     "prefill_ms": prefill, "ttft_agg_ms": ttft_agg,
                     "ttft_disagg_ms": _med([r["ttft_ms"] for r in runs]), "exposed_ms": ex,
                     "exposed_pct": round(100 * ex / prefill, 3) if prefill else None,
                     "transfer_ms": _med([kb["transfer"]["ms"]["total"] for kb in kbs]),
                     "kv_bytes": kbs[0]["transfer"]["bytes"], "agents_used": kbs[0]["transfer"]["agents"],
                     "fragments": kbs[0]["transfer"].get("fragments"),  # staged: one per packed layer range
                     "exact": all(r["tokens"] == want for r in runs)})
        print(table(rows[-1:], list(rows[-1])), flush=True)
    return rows


def load(urls: list[tuple[str, dict]], n: int, vocab: int, concurrency: int, requests: int,
         max_tokens: int) -> dict:
    """ITL (ms) and requests/s with `concurrency` requests in flight, spread over `urls` in turn."""
    def one(i: int):
        url, h = urls[i % len(urls)]
        return ask(url, _prompt(n, vocab, 1000 + i), max_tokens, h)

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(concurrency)))  # warm-up
        t0 = time.monotonic()
        got = list(pool.map(one, range(requests)))
        wall = time.monotonic() - t0
    itl = [(g["times"][-1] - g["times"][0]) * 1e3 / (len(g["times"]) - 1) for g in got if len(g["times"]) > 1]
    return {"prompt_tokens": n, "concurrency": concurrency, "requests": requests, "max_tokens": max_tokens,
            "itl_ms": _med(itl), "ttft_ms": _med([g["ttft_ms"] for g in got]),
            "req_per_s": round(requests / wall, 3)}


def run(a) -> dict[str, Any]:
    quick = a.quick
    model = QUICK_MODEL if quick else LLAMA8B
    vocab = 256 if quick else 128256
    sizes = [int(x) for x in a.prompts.split(",")]
    hetero_n = [s for s in sizes if s == a.hetero_tokens] or sizes[-1:]
    tpb, blocks = (16, 256) if quick else (32, a.blocks)
    g1, g0 = ("", "") if quick else ("cuda:1", "cuda:0")
    agents = [(x.split("/")[0], x.split("/")[1], STAGING if x.endswith("/staged") else {})
              for x in a.agents.split(",")]
    res: dict[str, Any] = {"model": model, "machine": machine(), "quick": quick, "rows": [], "load": {}}
    agg_cache: dict = {}
    # Phase A: TP1 -> TP1, one generation worker per agent
    ctx_extra = STAGING if any(p == "staged" for _, p, _x in agents) else {}
    gens = [_server(1, g0, ag, ex) for ag, _p, ex in agents]
    d = _config(model, _server(1, g1, "tcp" if quick else "auto", ctx_extra), gens[:1], quick, blocks, tpb)
    print(f"[bench serve] phase A: TP1 -> TP1, agents {[f'{x}/{p}' for x, p, _ in agents]}", flush=True)
    dep = Deployment(d, [{"instances": 1, **g} for g in gens[1:]]) if "A" in a.phases else None
    try:
        if dep is None:
            raise _Skip
        agg = dep.cluster.cfg.context[0].url
        broken: set[int] = set()
        for n in sizes:
            for gi, (ag, p, _x) in enumerate(agents):
                if gi in broken:
                    continue
                try:
                    res["rows"] += measure(dep, gi, n, a.repeat, vocab, ag, p, "tp1->tp1", agg, agg_cache)
                    _save(a, res)
                except RuntimeError as e:  # recorded, and that agent left out of the larger prompts
                    print(f"[bench serve] {ag}/{p} at {n} tokens failed: {e}", flush=True)
                    res.setdefault("errors", []).append({"prompt_tokens": n, "agent": ag, "path": p,
                                                         "error": str(e)[:400]})
                    broken.add(gi)
        hs = dep.cluster.headers
        aggs = [(dep.cluster.cfg.context[0].url, hs), (dep.gens[0][0], hs)]
        ln = a.load_tokens
        res["load"]["disaggregated"] = load([(dep.router(0, True), {})], ln, vocab, a.concurrency, a.requests,
                                            a.max_tokens)
        res["load"]["aggregated"] = load(aggs, ln, vocab, a.concurrency, a.requests, a.max_tokens)
        print(json.dumps(res["load"]), flush=True)
        _save(a, res)
    except _Skip:
        pass
    finally:
        if dep is not None:
            dep.stop()
    ag0 = agents[0][0]
    phases = [("tp1->tp2", _server(1, g1, ag0), _server(2, g0, ag0)),
              ("tp2->tp1", _server(2, g0, ag0), _server(1, g0, ag0))]
    for layout, ctx, gen in phases if "B" in a.phases else []:
        print(f"[bench serve] phase B: {layout}", flush=True)
        dep = Deployment(_config(model, ctx, [gen], quick, blocks, tpb))
        try:
            agg = dep.cluster.cfg.context[0].url
            for n in hetero_n:
                res["rows"] += measure(dep, 0, n, a.repeat, vocab, ag0, "direct", layout, agg, {})
                _save(a, res)
        finally:
            dep.stop()
    if "C" in a.phases:
        print("[bench serve] phase C: NIXL with UCX over TCP, direct and staged through host memory", flush=True)
        # the context worker has a host arena for the staged row's reader; the direct reader asks for no staging.
        # Over a slow link the last layer group's read is what stays exposed: finer groups (--tcp-stream-layers)
        st = a.tcp_stream_layers
        dep = Deployment(_config(model, _server(1, g1, "nixl", HOST_STAGING, stream=st),
                                 [_server(1, g0, "nixl", stream=st)], quick, blocks, tpb),
                         [{"instances": 1, **_server(1, g0, "nixl", HOST_STAGING, stream=st)}], env=UCX_TCP)
        try:
            agg, cache = dep.cluster.cfg.context[0].url, {}
            for gi, path in enumerate(("direct", "staged-host")):
                for n in hetero_n:
                    try:
                        res["rows"] += measure(dep, gi, n, a.repeat, vocab, "nixl-tcp", path, "tp1->tp1", agg, cache)
                        _save(a, res)
                    except RuntimeError as e:
                        print(f"[bench serve] nixl over TCP ({path}) failed: {e}", flush=True)
                        res.setdefault("errors", []).append({"agent": "nixl-tcp", "path": path, "error": str(e)[:400]})
        finally:
            dep.stop()
    return res


def _save(a, res: dict) -> None:
    """The rows so far (a run cut short by its time bound keeps what it measured)."""
    if a.json:
        with open(a.json + ".partial", "w") as f:
            json.dump(res, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvbridge bench serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="CPU, a tiny model, the tcp agent, short prompts")
    ap.add_argument("--prompts", default=None, help="prompt lengths (default 1024,4096,8192; quick 64,512)")
    ap.add_argument("--hetero-tokens", type=int, default=None, help="prompt length of the hetero/TCP rows")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--blocks", type=int, default=1280, help="KV blocks per worker (32 tokens each on GPU)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per request of the load run")
    ap.add_argument("--load-tokens", type=int, default=None, help="prompt length of the load run")
    ap.add_argument("--agents", default=None, help="phase A: agent/path,... (default cuda_ipc/direct,nixl/direct,"
                    "nixl/staged; quick: tcp/direct); the first runs in the deployment, the others in extra "
                    "generation workers")
    ap.add_argument("--phases", default=None, help="A: TP1->TP1 + load, B: hetero TP, C: NIXL over TCP (default "
                    "ABC; quick: AB, C only when named)")
    ap.add_argument("--tcp-stream-layers", type=int, default=1,
                    help="phase C: layers per streamed group (A and B: 4); over TCP the last group's read is exposed")
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None, help="default: the --json path with .png")
    a = ap.parse_args(argv)
    a.prompts = a.prompts or ("64,512" if a.quick else "1024,4096,8192")
    a.phases = a.phases or ("AB" if a.quick else "ABC")
    a.agents = a.agents or ("tcp/direct" if a.quick else "cuda_ipc/direct,nixl/direct,nixl/staged")
    a.hetero_tokens = a.hetero_tokens or (512 if a.quick else 8192)
    a.requests = a.requests or (4 if a.quick else 16)
    a.max_tokens = a.max_tokens or (4 if a.quick else 32)
    a.load_tokens = a.load_tokens or (64 if a.quick else 4096)
    if a.quick:
        a.repeat, a.concurrency = min(a.repeat, 2), min(a.concurrency, 2)
    res = run(a)
    res["command"] = "kvbridge bench serve " + " ".join(argv if argv is not None else sys.argv[1:])
    cols = ["prompt_tokens", "agent", "path", "layout", "streaming", "prefill_ms", "ttft_agg_ms", "ttft_disagg_ms",
            "exposed_ms", "exposed_pct", "exact"]
    print(table(res["rows"], cols))
    print(json.dumps(res["load"]))
    write_json(a.json, res)
    if a.json and os.path.exists(a.json + ".partial"):
        os.remove(a.json + ".partial")
    png = a.png or (a.json[:-5] + ".png" if a.json and a.json.endswith(".json") else None)
    if png:
        _png(png, res)
    return 0 if all(r["exact"] for r in res["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
