"""`python -m kvbridge.bench.vllm_route --quick --policies kv_aware`: vLLM servers under `kvbridge serve`'s own
launcher (`disagg_cluster: {}`, so each server runs under a member that relays its KV events; the control plane
and the relayed events on CurveZMQ with the keys the launcher makes) answer every prompt, the router's index
holds blocks of the prefill servers (their events reached it through CurveZMQ), and vLLM reused prefixes.
Speed is not checked here (bench/RESULTS.md has the measured numbers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .conftest import needs_vllm

pytestmark = [needs_vllm, pytest.mark.slow, pytest.mark.timeout(900)]


def test_the_quick_route_bench_routes_by_relayed_events_over_curve(tmp_path):
    out = tmp_path / "route.json"
    r = subprocess.run([sys.executable, "-m", "kvbridge.bench.vllm_route", "--quick", "--policies", "kv_aware",
                        "--json", str(out)], capture_output=True, text=True, timeout=850, env=dict(os.environ))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["requests"] == 6 and row["identical"], row
    ctx = {k: v for k, v in row["router_index_blocks"].items() if k.startswith("ctx")}
    assert len(ctx) == 2 and sum(ctx.values()) >= 2, row  # each prefix's blocks, relayed over CurveZMQ
    assert row["hit_tokens"] > 0, row
    assert (tmp_path / "route.png").exists()
