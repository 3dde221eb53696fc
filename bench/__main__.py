"""`kvbridge bench <name> ...` (or `python -m kvbridge.bench <name> ...`): the benchmarks, each writing JSON."""

from __future__ import annotations

import importlib
import sys

BENCHES = {  # name: (module, one line)
    "transfer": ("kvbridge.bench.transfer", "scattered-READ bandwidth of each agent vs memcpy, 2 processes"),
    "plan": ("kvbridge.bench.plan", "plan-building time for an 8k-token Llama-70B request"),
    "control": ("kvbridge.bench.control", "the control plane's cost per request (p50/p99, requests/s)"),
    "prefix": ("kvbridge.bench.prefix", "multi-turn chat through the router, prefix reuse on vs off"),
    "soak": ("kvbridge.bench.soak", "the reliability soak: mutated frames, a hammered live rank, requests"),
    "serve": ("kvbridge.bench.serve", "TTFT aggregated vs disaggregated through router and workers, overlap on/off"),
    "vllm": ("kvbridge.bench.vllm", "real vLLM: aggregated vs NixlConnector vs KVBridgeConnector"),
    "vllm-cells": ("kvbridge.bench.vllm_cells", "issue 28's cells, NixlConnector and KVBridgeConnector in one run"),
    "route": ("kvbridge.bench.route", "KV-aware routing vs round_robin / least_loaded / prefix_aware, 3 workloads"),
}


def usage() -> str:
    w = max(map(len, BENCHES))
    lines = ["usage: kvbridge bench <name> [--json PATH] ...    (kvbridge bench <name> --help: its options)",
             "",
             "benchmarks (results and their commands: bench/RESULTS.md):"]
    return "\n".join(lines + [f"  {n:<{w}}  {d}" for n, (_, d) in BENCHES.items()])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if not argv or argv[0] not in BENCHES:
        what = f"unknown benchmark {argv[0]!r}" if argv else "name a benchmark"
        print(f"kvbridge bench: {what}\n\n{usage()}", file=sys.stderr)
        return 2
    return int(importlib.import_module(BENCHES[argv[0]][0]).main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
