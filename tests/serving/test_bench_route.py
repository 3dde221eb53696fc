"""`kvbridge bench route --quick` runs end to end (real workers, both policies it compares, all three
workloads) and writes the rows the issue asks for, every answer equal to aggregated decoding; its `--trace`
is read by `python -m kvbridge.bench.route_trace` as docs/routing-cost.md shows. Speed and
prefill counts are measured by the bench, never asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIELDS = {"workload", "policy", "prefill_tokens", "oracle_prefill_tokens", "kv_bytes_moved", "ttft_p50_ms",
          "ttft_p90_ms", "req_per_s", "identical"}


def test_bench_route_quick_writes_every_row_with_answers_equal_to_aggregated(tmp_path):
    out, trace = str(tmp_path / "route.json"), str(tmp_path / "route.trace")
    r = subprocess.run([sys.executable, "-m", "kvbridge.bench", "route", "--quick", "--json", out, "--trace", trace],
                       capture_output=True, text=True, timeout=900, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # docs/routing-cost.md's second command reads that trace (the misses against the oracle, by cause)
    t = subprocess.run([sys.executable, "-m", "kvbridge.bench.route_trace", trace, "--workload", "chat"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert t.returncode == 0 and "kv_aware chat:" in t.stdout, t.stdout[-2000:] + t.stderr[-2000:]
    with open(out) as f:
        rows = json.load(f)["rows"]
    assert {(x["workload"], x["policy"]) for x in rows} == {(w, p) for w in ("chat", "shared_system", "no_reuse")
                                                             for p in ("round_robin", "kv_aware")}
    for x in rows:
        assert FIELDS <= set(x) and x["identical"] is True, x
        assert 0 < x["prefill_tokens"] <= x["prompt_tokens"]
    assert os.path.exists(str(tmp_path / "route.png"))
