"""`kvbridge bench vllm`: real vLLM on one machine: aggregated, + NixlConnector, + KVBridge, + KVBridge early.

The same tiny random Llama (integrations/vllm/tiny_model.py) and the same token-id prompts (128 / 512 / 2048
tokens, unique per request so no prefix cache hides a transfer), greedy. Per connector and prompt length:
TTFT p50/p90 (aggregated: to the first streamed token; disaggregated: the prefill hop + the decode hop's
first token, the protocol of serving/vllm_backend.py), the KV transfer's own time (p50) and bytes per
request (NixlConnector: the decode server's `vllm:nixl_*` histograms in /metrics, one request at a time;
KVBridgeConnector: the `kvbridge_transfer` {bytes, ms, read_ms, transport_ms} it answers in a non-streamed
decode's `kv_transfer_params`, from one more unique prompt per repetition; `read_ms_p50` is the like-for-like
column: the READs on NIXL's own clock for both (vLLM's histogram is NIXL's telemetry of NixlConnector's READ;
KVBridgeConnector's NIXL agents keep the same telemetry: `transport_ms`), `read_wall_ms_p50` kvbridge's reads
on its own clock (first READ posted -> last seen done, from Python), transfer_ms kvbridge's whole pull),
requests/s at a fixed concurrency, and
whether every prompt's tokens equal the aggregated server's. Servers run one configuration at a time (the
aggregated reference alone, as ../shared/vllm/ measured it): NixlConnector in its best configuration here
(prefill on core 0, decode on core 1, every thread pinned once up); KVBridgeConnector with vLLM's OpenMP
threads on those cores but no re-pinning (`--kvbridge-pin` adds it). `kvbridge_early`: servers configured
as for `kvbridge` (fresh ones: no prefix cache from the other rows), both hops sent together as kvbridge's router does once it knows the prefill engine (early decode: the decode
reads each layer as the prefill's forward writes it); TTFT from sending both to the first decoded token; its
transfer_ms / read_ms include the wait for the prefill's layers, so they are not a transfer's cost. Rows go
to bench/results/vllm.json, a plot beside it.

    kvbridge bench vllm [--quick] [--json PATH] [--lens 128 512 2048] [--reps 8] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from ..integrations.vllm.launch import VllmServer, VllmServerSpec, free_port, vllm_missing
from ..integrations.vllm.tiny_model import tiny_llama
from ..serving.vllm_backend import decode_body, early_hops, engine_of, prefill_body, stream_error
from .common import machine, table, write_json
from .plot import save_plot

__all__ = ["main", "run", "CONNECTORS"]

CONNECTORS = ("aggregated", "nixl", "kvbridge", "kvbridge_early")
CONNECTOR_MODULE = Path(__file__).resolve().parents[1] / "integrations" / "vllm" / "connector.py"
DEFAULT_JSON = str(Path(__file__).resolve().parent / "results" / "vllm.json")
# NixlConnector's decode-side histograms of one pull: (seconds, bytes); summed over label sets
TRANSFER_METRICS = {"nixl": ("vllm:nixl_xfer_time_seconds", "vllm:nixl_bytes_transferred")}
MAX_MODEL_LEN = 4096


def prompt_ids(n: int, seed: int) -> list[int]:
    r = random.Random(seed * 1_000_003 + n)
    return [r.randrange(3, 512) for _ in range(n)]


def _body(prompt: list[int], max_tokens: int, stream: bool) -> dict:
    b = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
         "return_token_ids": True, "stream": stream}
    return b


def _stream(client: httpx.Client, url: str, body: dict, timeout: float) -> tuple[float | None, list[int]]:
    """POST a streamed completion; (seconds to the first token, token ids). RuntimeError on any error."""
    t0 = time.perf_counter()
    ttft, ids = None, []
    with client.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if stream_error(obj):
                raise RuntimeError(f"{url}: {stream_error(obj)}")
            for ch in obj.get("choices") or []:
                if ch.get("token_ids") and ttft is None:
                    ttft = time.perf_counter() - t0
                ids += ch.get("token_ids") or []
    return ttft, ids


def kvbridge_transfer(client: httpx.Client, servers: dict, prompt: list[int], max_tokens: int,
                      timeout: float = 300.0) -> tuple[float | None, int | None, float | None, float | None]:
    """(ms, bytes, read ms, NIXL ms) of one prefill -> decode whose decode is not streamed: KVBridgeConnector
    answers them in the decode's kv_transfer_params (`kvbridge_transfer`; ms: the whole pull, read_ms: its
    reads from the first posted to the last seen done, transport_ms: the same on NIXL's clock)."""
    body = _body(prompt, max_tokens, False)
    if servers.get("early"):
        r = _early(client, servers, body, timeout, lambda kvp: client.post(
            servers["decode"] + "/v1/completions", json=decode_body(body, kvp), timeout=timeout))
    else:
        r = client.post(servers["prefill"] + "/v1/completions", json=prefill_body(body), timeout=timeout)
        kvp = r.json().get("kv_transfer_params")
        r = client.post(servers["decode"] + "/v1/completions", json=decode_body(body, kvp), timeout=timeout)
    t = (r.json().get("kv_transfer_params") or {}).get("kvbridge_transfer") or {}
    if r.status_code != 200 or t.get("error"):
        raise RuntimeError(f"decode: HTTP {r.status_code}: {str(r.json())[:300]}")
    return t.get("ms"), t.get("bytes"), t.get("read_ms"), t.get("transport_ms") or None


def one_request(client: httpx.Client, servers: dict, prompt: list[int], max_tokens: int,
                timeout: float = 300.0) -> tuple[float, list[int]]:
    """One request, aggregated or prefill -> decode; (TTFT seconds, token ids)."""
    if "agg" in servers:
        ttft, ids = _stream(client, servers["agg"], _body(prompt, max_tokens, True), timeout)
        return ttft, ids
    t0 = time.perf_counter()
    if servers.get("early"):
        body = _body(prompt, max_tokens, True)
        t, ids = _early(client, servers, body, timeout, lambda kvp: (
            time.perf_counter(), _stream(client, servers["decode"], decode_body(body, kvp), timeout)))
        return t - t0 + (ids[0] or 0.0), ids[1]
    body = _body(prompt, max_tokens, False)
    r = client.post(servers["prefill"] + "/v1/completions", json=prefill_body(body), timeout=timeout)
    data = r.json()
    if r.status_code != 200 or not isinstance(data.get("kv_transfer_params"), dict):
        raise RuntimeError(f"prefill: HTTP {r.status_code}: {str(data)[:300]}")
    hop = time.perf_counter() - t0
    ttft, ids = _stream(client, servers["decode"], decode_body(_body(prompt, max_tokens, True),
                                                               data["kv_transfer_params"]), timeout)
    return hop + (ttft or 0.0), ids


_local = threading.local()


def _early(client: httpx.Client, servers: dict, body: dict, timeout: float, decode):
    """Both hops at once (serving/vllm_backend.py's early decode): the prefill hop on a thread of its own,
    `decode(kv_transfer_params)` here; returns what decode returns. The engine is learnt once, as the router
    does, from an ordinary answer."""
    if "engine" not in servers:
        r = client.post(servers["prefill"] + "/v1/completions", json=prefill_body(_body([3, 4, 5], 1, False)),
                        timeout=timeout)
        servers["engine"] = engine_of(r.json().get("kv_transfer_params")) or {}
    pre = prefill_body({**body, "stream": False})
    pre["kv_transfer_params"]["kvbridge_early"], kvp = early_hops(servers["engine"])
    if not hasattr(_local, "hop"):  # one prefill-hop thread (and connection) per calling thread
        _local.hop = ThreadPoolExecutor(1)
    answer = _local.hop.submit(_hop_post, servers["prefill"], pre, timeout)
    try:
        out = decode(kvp)
    finally:
        r = answer.result(timeout)  # the prefill answers a step after the decode's first token
    if isinstance(r, Exception) or r.status_code != 200:
        raise RuntimeError(f"early prefill hop failed: {r if isinstance(r, Exception) else r.text[:300]}")
    return out


def _hop_post(url: str, body: dict, timeout: float):
    if not hasattr(_local, "client"):
        _local.client = httpx.Client()
    try:
        return _local.client.post(url + "/v1/completions", json=body, timeout=timeout)
    except httpx.HTTPError as e:
        return e


def metric_sums(client: httpx.Client, url: str, names: tuple[str, ...]) -> dict[str, float]:
    """`<name>_sum` and `<name>_count` of each histogram (summed over label sets) from url/metrics."""
    out: dict[str, float] = {}
    try:
        text = client.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return out
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, val = line.rpartition(" ")
        name = key.split("{")[0]
        if any(name in (n + "_sum", n + "_count") for n in names):
            try:
                out[name] = out.get(name, 0.0) + float(val)
            except ValueError:
                pass
    return out


def _transfer(client: httpx.Client, url: str, names: tuple[str, str], before: dict, settle_s: float):
    """(ms, bytes) the decode server recorded for the request since `before` (waits, bounded, for them)."""
    deadline = time.monotonic() + settle_s
    while True:
        now = metric_sums(client, url, names)
        seen = now.get(names[0] + "_count", 0) > before.get(names[0] + "_count", 0)
        if seen or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if now.get(names[0] + "_count", 0) <= before.get(names[0] + "_count", 0):
        return None, None
    d = {k: now.get(k, 0.0) - before.get(k, 0.0) for k in now}
    return d.get(names[0] + "_sum", 0.0) * 1e3, d.get(names[1] + "_sum")


def _pct(xs: list[float], q: float) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def measure(name: str, servers: dict, a, ref: dict | None) -> tuple[list[dict], dict]:
    """Every row of one configuration (its servers up); returns (rows, tokens by (len, rep))."""
    client = httpx.Client()
    for s in (9001, 9002, 9003):  # warm-up: first requests pay compiles, handshakes, allocator growth
        try:
            one_request(client, servers, prompt_ids(64, s), 4)
        except RuntimeError as e:  # counted in the measured requests only; said here
            print(f"{name}: warm-up request failed: {e}", flush=True)
    names = TRANSFER_METRICS.get(name)
    rows, tokens = [], {}
    for n in a.lens:
        ttfts, xfer_ms, xfer_bytes, read_ms, wall_ms, errors = [], [], [], [], [], []
        for rep in range(a.reps):
            before = metric_sums(client, servers["decode"], names) if names else {}
            try:
                ttft, ids = one_request(client, servers, prompt_ids(n, 1000 * rep + n), a.max_tokens)
            except RuntimeError as e:  # a failed request is a row's error, not the end of the run
                errors.append(str(e)[:200])
                continue
            ttfts.append(ttft * 1e3)
            tokens[(n, rep)] = ids
            if names:
                ms, nb = _transfer(client, servers["decode"], names, before, a.settle_s)
                rd, wall = ms, None  # vLLM's NIXL metric is the READ alone (NIXL's xferDuration)
            elif name.startswith("kvbridge"):
                try:
                    ms, nb, wall, nixl_ms = kvbridge_transfer(
                        client, servers, prompt_ids(n, 300_000 + 1000 * rep + n), a.max_tokens)
                    rd = nixl_ms if nixl_ms is not None else wall  # like for like: NIXL's clock for both
                except RuntimeError as e:
                    errors.append(str(e)[:200])
                    continue
            if name != "aggregated":
                xfer_ms.append(ms)
                read_ms.append(rd)
                wall_ms.append(wall)
                xfer_bytes.append(nb)
        rps = throughput(servers, n, a)
        same = not errors and (ref is None or all(ref.get((n, r)) == tokens.get((n, r))
                                                  for r in range(a.reps)))
        nb = [b for b in xfer_bytes if b is not None]
        rows.append({"connector": name, "prompt_tokens": n, "ttft_p50_ms": _pct(ttfts, 0.5),
                     "ttft_p90_ms": _pct(ttfts, 0.9), "transfer_ms_p50": _pct(xfer_ms, 0.5),
                     "read_ms_p50": _pct([x for x in read_ms if x is not None], 0.5),
                     "read_wall_ms_p50": _pct([x for x in wall_ms if x is not None], 0.5),
                     "kv_bytes": int(statistics.median(nb)) if nb else None, "req_per_s": rps,
                     "tokens_identical": same, "requests": a.reps, "transfers_seen": len(nb),
                     "errors": errors})
        print(table(rows[-1:], list(rows[-1])), flush=True)
    client.close()
    return rows, tokens


def throughput(servers: dict, n: int, a) -> float:
    """Requests/s of `a.rate_requests` unique prompts of `n` tokens at `a.concurrency` in flight."""
    seeds = iter(range(a.rate_requests))

    def worker(_):
        with httpx.Client() as c:
            while True:
                try:
                    s = next(seeds)
                except StopIteration:
                    return
                try:
                    one_request(c, servers, prompt_ids(n, 500_000 + 1000 * s + n), a.max_tokens)
                    done.append(s)
                except RuntimeError as e:
                    print(f"req/s: a request failed: {e}", flush=True)

    done: list[int] = []
    t0 = time.perf_counter()
    with ThreadPoolExecutor(a.concurrency) as ex:
        list(ex.map(worker, range(a.concurrency)))
    return len(done) / (time.perf_counter() - t0)


def _specs(name: str, model: str, a) -> dict[str, VllmServerSpec]:
    common = dict(model=model, served_model_name="tiny", max_model_len=MAX_MODEL_LEN, python=a.python)
    if name == "aggregated":
        return {"agg": VllmServerSpec(port=free_port(), cpus="0", **common)}
    if name == "nixl":
        kv = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
        pin = True
    else:
        kv = {"kv_connector": "KVBridgeConnector", "kv_role": "kv_both",
              "kv_connector_module_path": "kvbridge.integrations.vllm.connector",
              "kv_connector_extra_config": {}}
        pin = a.kvbridge_pin
    return {role: VllmServerSpec(port=free_port(), cpus=core, pin=pin, kv_transfer_config=kv,
                                 side_channel_port=free_port(), **common)
            for role, core in (("prefill", "0"), ("decode", "1"))}


def run_one(name: str, model: str, a, ref: dict | None) -> tuple[list[dict], dict]:
    """Start one configuration's servers, measure, stop them (always)."""
    servers = {role: VllmServer(spec, os.path.join(a.log_dir, f"{name}-{role}.log"))
               for role, spec in _specs(name, model, a).items()}
    try:
        for s in servers.values():  # both at once: a start is mostly one core's imports (a pair 38 -> 19 s)
            s.start()
        for s in servers.values():
            s.wait_healthy(a.startup_timeout)
        urls = {role: s.url for role, s in servers.items()}
        return measure(name, {**urls, "early": True} if name == "kvbridge_early" else urls, a, ref)
    finally:
        for s in servers.values():
            s.stop()


def run(a) -> list[dict]:
    model = str(tiny_llama())
    rows, ref = [], None
    for name in a.connectors:
        if name == "kvbridge" and not CONNECTOR_MODULE.exists():
            print(f"kvbridge: skipped ({CONNECTOR_MODULE} is not there yet)", flush=True)
            continue
        r, tokens = run_one(name, model, a, ref)
        rows += r
        if name == "aggregated":
            ref = tokens
    return rows


def plot(rows: list[dict], path: str) -> None:
    def draw(fig):
        lens = sorted({r["prompt_tokens"] for r in rows})
        names = [c for c in CONNECTORS if any(r["connector"] == c for r in rows)]
        panels = (("ttft_p50_ms", "TTFT p50 (ms)"), ("transfer_ms_p50", "KV transfer p50 (ms, whole pull)"),
                  ("read_ms_p50", "KV READs p50 (ms, NIXL's telemetry for both)"), ("req_per_s", "requests/s"))
        for i, (key, label) in enumerate(panels):
            ax = fig.add_subplot(1, len(panels), i + 1)
            w = 0.8 / max(1, len(names))
            for j, c in enumerate(names):
                vals = [next((r[key] or 0 for r in rows if (r["connector"], r["prompt_tokens"]) == (c, n)), 0)
                        for n in lens]
                ax.bar([k + j * w for k in range(len(lens))], vals, w, label=c)
            ax.set_xticks([k + w * (len(names) - 1) / 2 for k in range(len(lens))], [str(n) for n in lens])
            ax.set_xlabel("prompt tokens")
            ax.set_title(label)
            if i == 0:
                ax.legend()

    save_plot(path, draw, f"vLLM prefill/decode on CPU, tiny Llama ({machine()})", (14.0, 4.2))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="kvbridge bench vllm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 lengths, 2 prompts each, 4 requests for req/s")
    ap.add_argument("--json", default=None, help=f"where the rows go (default {DEFAULT_JSON}; --quick: none)")
    ap.add_argument("--lens", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--reps", type=int, default=8, help="prompts per length for TTFT and transfer")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--rate-requests", type=int, default=16, help="requests per length for req/s")
    ap.add_argument("--connectors", nargs="+", default=list(CONNECTORS), choices=CONNECTORS)
    ap.add_argument("--kvbridge-pin", action="store_true", help="pin KVBridgeConnector's servers like NIXL's")
    ap.add_argument("--settle-s", type=float, default=3.0, help="wait (bounded) for a transfer's metrics")
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--python", default=None,
                    help="vLLM's interpreter (default $KVBRIDGE_VLLM_PYTHON or .venv-vllm)")
    ap.add_argument("--log-dir", default=None, help="the servers' logs (default: a temporary folder)")
    a = ap.parse_args(argv)
    if a.quick:
        a.lens, a.reps, a.rate_requests, a.concurrency, a.max_tokens = [128, 512], 2, 4, 2, 8
    from ..integrations.vllm.launch import vllm_python

    a.python = a.python or vllm_python()
    why = vllm_missing(a.python)
    if why:
        print(f"kvbridge bench vllm: {why}", file=sys.stderr)
        return 2
    if "aggregated" not in a.connectors:
        a.connectors = ["aggregated", *a.connectors]  # the reference tokens

    a.log_dir = a.log_dir or tempfile.mkdtemp(prefix="kvbridge-bench-vllm-")
    rows = run(a)
    print(table(rows, ["connector", "prompt_tokens", "ttft_p50_ms", "ttft_p90_ms", "transfer_ms_p50",
                       "read_ms_p50", "read_wall_ms_p50", "kv_bytes", "req_per_s", "tokens_identical"]))
    path = a.json or (None if a.quick else DEFAULT_JSON)
    if path:
        write_json(path, rows)
        plot(rows, os.path.splitext(path)[0] + ".png")
    bad = [f"{r['connector']}@{r['prompt_tokens']}" for r in rows if not r["tokens_identical"]]
    if bad:
        print(f"tokens differ from aggregated: {bad}", file=sys.stderr)
    return 1 if bad else 0
