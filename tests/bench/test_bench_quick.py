"""Every `kvbridge bench` subcommand the README names, in a quick form (small sizes), through the real CLI in
a subprocess: a broken benchmark fails the suite. Speed is never asserted here, only that each runs to the
end, exits 0 and writes its JSON. The GPU form (`bench transfer --device cuda`) skips on a machine without
two CUDA GPUs, saying so; its own numbers come from the device runs (bench/RESULTS.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

TIMEOUT_S = 600  # a busy 2-core box; each takes seconds to a minute or so when the machine is free
pytestmark = pytest.mark.timeout(TIMEOUT_S + 60)


def _bench(tmp_path, name: str, *args: str) -> object:
    out = tmp_path / f"{name}.json"
    p = subprocess.run([sys.executable, "-m", "kvbridge.bench", name, *args, "--json", str(out)],
                       capture_output=True, text=True, timeout=TIMEOUT_S)
    assert p.returncode == 0, f"kvbridge bench {name} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    assert out.exists(), f"kvbridge bench {name} wrote no JSON:\n{p.stdout[-2000:]}"
    return json.loads(out.read_text())


def test_bench_transfer_quick(tmp_path):
    rows = _bench(tmp_path, "transfer", "--agents", "tcp", "--sizes", "64K", "--total", "4M", "--repeat", "1")
    assert rows


def test_bench_transfer_cuda_quick(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("bench transfer --device cuda needs two CUDA GPUs (this machine has "
                    f"{torch.cuda.device_count() if torch.cuda.is_available() else 0})")
    rows = _bench(tmp_path, "transfer", "--device", "cuda", "--total", "64M", "--sizes", "65536", "--reps", "1")
    assert rows


def test_bench_plan_quick(tmp_path):
    assert _bench(tmp_path, "plan", "--tokens", "512", "--repeat", "2")


def test_bench_control_quick(tmp_path):
    assert _bench(tmp_path, "control", "--gens", "1", "--requests", "50", "--window", "8")


def test_bench_prefix_quick(tmp_path):
    """As the README gives it (--quick), smaller still: it reads the workers' /metrics with the internal
    token (the deployment is closed by default)."""
    res = _bench(tmp_path, "prefix", "--quick", "--conversations", "2", "--turns", "2", "--threads", "2")
    assert res["identical"] is True


def test_bench_soak_quick(tmp_path):
    res = _bench(tmp_path, "soak", "--frames", "2000", "--live-frames", "500", "--requests", "20",
                 "--concurrency", "4", "--no-restart", "--no-bombs")
    assert res


def test_bench_serve_quick(tmp_path):
    """The CPU form of bench serve: the real router and workers, overlap off and on, exact tokens; a second
    agent/path runs in an extra generation worker started by the bench (it must get the deployment's CurveZMQ
    keys: without them the context rank refuses its hello, as the first GPU run of the NIXL rows found)."""
    res = _bench(tmp_path, "serve", "--quick", "--prompts", "64", "--phases", "A", "--repeat", "1",
                 "--requests", "2", "--agents", "tcp/direct,tcp/staged")
    assert not res.get("errors"), res.get("errors")
    assert {(r["agent"], r["path"]) for r in res["rows"]} == {("tcp", "direct"), ("tcp", "staged")}
    assert res["rows"] and all(r["exact"] for r in res["rows"])
    assert {r["streaming"] for r in res["rows"]} == {False, True}
    assert res["load"]["disaggregated"]["req_per_s"] > 0
