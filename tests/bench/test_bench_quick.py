"""Every `kvbridge bench` subcommand the README and docs/*.md name, in a quick form (small sizes), through the
real CLI in a subprocess: a broken benchmark fails the suite. Speed is never asserted here, only that each
runs to the end, exits 0 and writes its JSON. The GPU form (`bench transfer --device cuda`) skips on a
machine without two CUDA GPUs, saying so; its own numbers come from the device runs (bench/RESULTS.md).
`bench route` and `bench vllm` have their quick tests beside the code they drive (QUICK_TESTS below); the
last test here keeps the docs and this list in step (issue 24)."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 600  # a busy 2-core box; each takes seconds to a minute or so when the machine is free
pytestmark = pytest.mark.timeout(TIMEOUT_S + 60)


def _bench(tmp_path, name: str, *args: str, cwd: str | None = None) -> object:
    """`kvbridge bench NAME ARGS --json PATH` as a user types it (the CLI's own dispatch); its JSON."""
    out = tmp_path / f"{name}.json"
    p = subprocess.run([sys.executable, "-m", "kvbridge.cli", "bench", name, *args, "--json", str(out)],
                       capture_output=True, text=True, timeout=TIMEOUT_S, cwd=cwd)
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
    rows = _bench(tmp_path, "transfer", "--device", "cuda", "--agents", "nixl,nccl", "--sizes", "4K,64K",
                  "--total", "64M", "--repeat", "1")  # the README's GPU rows, small
    assert rows and all(r.get("verified", True) for r in rows)


def test_bench_transfer_host_rows_as_the_readme_gives_them(tmp_path):
    """The README's host-row command (a MODULE:CLASS agent found from the checkout's root), small."""
    rows = _bench(tmp_path, "transfer", "--agents", "nixl,examples.custom_agent:CmaAgent,tcp,gloo",
                  "--repeat", "1", "--sizes", "64K", "--total", "4M", cwd=ROOT)
    assert {r["agent"] for r in rows} == {"nixl", "CmaAgent", "tcp", "gloo"}, rows
    assert all(r["verified"] for r in rows), rows


def test_bench_plan_quick(tmp_path):
    assert _bench(tmp_path, "plan", "--tokens", "512", "--repeat", "2")


def test_bench_control_quick(tmp_path):
    assert _bench(tmp_path, "control", "--gens", "1", "--requests", "50", "--window", "8")


def test_bench_control_without_read_ahead_quick(tmp_path):
    """docs/cli.md's `bench control --no-read-ahead` (the generation side asks before it reads)."""
    assert _bench(tmp_path, "control", "--no-read-ahead", "--gens", "1", "--requests", "50", "--window", "8")


def test_bench_prefix_as_printed(tmp_path):
    """`kvbridge bench prefix --quick --json PATH` exactly as docs/cli.md and docs/prefix-reuse.md print it
    (8 conversations x 3 turns, one worker per role; about 35 s on a busy 2-core box). It reads the workers'
    /metrics with the internal token (the deployment is closed by default)."""
    res = _bench(tmp_path, "prefix", "--quick")
    assert res["identical"] is True and (res["conversations"], res["turns"]) == (8, 3), res
    assert res["reuse"]["prefill_tokens"] < res["no_reuse"]["prefill_tokens"], res
    assert (tmp_path / "prefix.png").exists()


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


def test_bench_serve_quick_phase_c_rows_direct_and_staged_through_host_memory(tmp_path):
    """Phase C's two rows (NIXL with UCX forced to TCP: direct, and staged through host memory, streamed) on
    CPU: the plumbing the GPU run relies on, exact tokens; the staged row's reads are its packed layer ranges."""
    res = _bench(tmp_path, "serve", "--quick", "--prompts", "64", "--hetero-tokens", "256", "--phases", "C",
                 "--repeat", "1")
    assert not res.get("errors"), res.get("errors")
    assert {(r["agent"], r["path"]) for r in res["rows"]} == {("nixl-tcp", "direct"), ("nixl-tcp", "staged-host")}
    assert res["rows"] and all(r["exact"] for r in res["rows"])
    staged = [r for r in res["rows"] if r["path"] == "staged-host"]
    # 8 layers marked ready one at a time (--tcp-stream-layers 1): at most one read per packed layer range
    assert all(1 <= r["fragments"] <= 8 for r in staged), staged


def test_control_trace_quick():
    """docs/control-plane.md's `python -m kvbridge.bench.control_trace`: it wraps the transceiver's private
    methods by name, so a renamed hop would silently drop out of its table; the main hops must be there."""
    p = subprocess.run([sys.executable, "-m", "kvbridge.bench.control_trace", "--requests", "20"],
                       capture_output=True, text=True, timeout=TIMEOUT_S)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "publish -> complete" in p.stdout, p.stdout
    hops = {line.split()[0] for line in p.stdout.splitlines() if line and not line.startswith("#")}
    assert {"c.publish", "g.fetch_sent", "g.reads_done", "c.io_frames", "c.report", "g.io_done_ack"} <= hops, \
        p.stdout
    assert {"c.io_done", "c.io_fetch"} & hops, p.stdout  # a Fetch may carry its Done (protocol 4)


def test_control_floor_quick(tmp_path):
    """docs/control-plane.md's `python -m kvbridge.bench.control_floor`: every bare hop answers, JSON + PNG; with
    a pause before each round (`--idle-us`) the rows say it; a pause out of range is refused by name."""
    out = tmp_path / "floor.json"
    p = subprocess.run([sys.executable, "-m", "kvbridge.bench.control_floor", "--rounds", "50", "--idle-us", "200",
                        "--json", str(out)], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads(out.read_text())
    rows = rows["rows"] if isinstance(rows, dict) else rows
    assert {(r["hop"], r["wait"]) for r in rows} == {("pipe", "block"), ("zmq_ipc", "block"), ("zmq_tcp", "block"),
                                                      ("zmq_ipc", "spin"), ("zmq_tcp", "spin")}
    assert all(r["rtt_p50_us"] > 0 and r["idle_us"] == 200 for r in rows)
    assert out.with_suffix(".png").exists()
    bad = subprocess.run([sys.executable, "-m", "kvbridge.bench.control_floor", "--idle-us", "-1"],
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    assert bad.returncode == 2 and "--idle-us must be between" in bad.stderr, bad.stderr[-2000:]


def test_tls_cost_quick(tmp_path):
    """docs/security.md's `python -m kvbridge.bench.tls_cost`: plain and HTTPS deployments answer, every row
    written, JSON + PNG (skips without the openssl command line, which makes its certificates)."""
    import shutil

    if not shutil.which("openssl"):
        pytest.skip("needs the openssl command line to make test certificates")
    out = tmp_path / "tls.json"
    p = subprocess.run([sys.executable, "-m", "kvbridge.bench.tls_cost", "--requests", "4", "--json", str(out)],
                       capture_output=True, text=True, timeout=TIMEOUT_S)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads(out.read_text())
    rows = rows["rows"] if isinstance(rows, dict) else rows
    assert [(r["mode"], r["connection"]) for r in rows] == [
        ("http", "kept alive"), ("http", "new each request"), ("https", "kept alive"), ("https", "new each request")]
    assert all(r["p50_ms"] > 0 for r in rows) and out.with_suffix(".png").exists()


def test_read_ab_quick(tmp_path):
    """`python -m kvbridge.bench.read_ab` (docs/pipelined-parts.md): one size, one READ per mode, on two GPUs."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("bench read_ab reads between two CUDA GPUs (this machine has "
                    f"{torch.cuda.device_count() if torch.cuda.is_available() else 0})")
    out = tmp_path / "read_ab.json"
    p = subprocess.run([sys.executable, "-m", "kvbridge.bench.read_ab", "--sizes", "65536", "--reps", "1",
                        "--json", str(out)], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert p.returncode == 0, f"read_ab exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    assert out.exists()


QUICK_TESTS = {  # bench name -> the test that runs it in a quick form (file relative to the checkout)
    "transfer": "tests/bench/test_bench_quick.py::test_bench_transfer_quick",
    "plan": "tests/bench/test_bench_quick.py::test_bench_plan_quick",
    "control": "tests/bench/test_bench_quick.py::test_bench_control_quick",
    "prefix": "tests/bench/test_bench_quick.py::test_bench_prefix_as_printed",
    "soak": "tests/bench/test_bench_quick.py::test_bench_soak_quick",
    "serve": "tests/bench/test_bench_quick.py::test_bench_serve_quick",
    "route": "tests/serving/test_bench_route.py::"
             "test_bench_route_quick_writes_every_row_with_answers_equal_to_aggregated",
    "vllm": "tests/vllm/test_bench_vllm.py::test_the_quick_bench_writes_every_row_with_identical_tokens",
    "vllm-cells": "tests/vllm/test_bench_vllm_cells.py::test_the_tp1_cell_runs_both_connectors_and_kvbridge_is_exact",
    "control_trace": "tests/bench/test_bench_quick.py::test_control_trace_quick",  # python -m kvbridge.bench.X
    "route_trace": "tests/serving/test_bench_route.py::"
                   "test_bench_route_quick_writes_every_row_with_answers_equal_to_aggregated",
    "read_ab": "tests/bench/test_bench_quick.py::test_read_ab_quick",  # two GPUs: skips here, runs on the GPU host
    "control_floor": "tests/bench/test_bench_quick.py::test_control_floor_quick",
    "tls_cost": "tests/bench/test_bench_quick.py::test_tls_cost_quick",
    "nixl_post": "tests/bench/test_nixl_post.py::test_nixl_post_quick",
}


def test_every_bench_the_docs_name_has_a_quick_test():
    """Issue 24: a `kvbridge bench NAME` (or `python -m kvbridge.bench.NAME`) in README.md or docs/*.md, or
    in the CLI's list, that no quick test runs fails here, naming where it is shown."""
    from kvbridge.bench.__main__ import BENCHES

    shown: dict[str, str] = {name: "bench/__main__.py BENCHES" for name in BENCHES}
    for path in [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                for m in re.finditer(r"kvbridge bench ([a-z][\w-]*)|kvbridge\.bench\.([a-z]\w*)", line):
                    shown.setdefault(m.group(1) or m.group(2), f"{os.path.relpath(path, ROOT)}:{n}")
    missing = {name: where for name, where in shown.items() if name not in QUICK_TESTS}
    assert not missing, f"benches shown without a quick test (add one, and a QUICK_TESTS entry): {missing}"
    for name, test in QUICK_TESTS.items():
        path, func = test.split("::")
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            assert re.search(rf"^def {func}\(", f.read(), re.M), f"{name}: {test} does not exist"


def test_metric_samples_read_prometheus_text_as_vllm_and_the_router_write_it():
    from kvbridge.bench.common import metric_by, metric_samples, metric_sum

    text = "\n".join([
        "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.",
        "# TYPE vllm:prefix_cache_hits_total counter",
        'vllm:prefix_cache_hits_total{engine="0",model_name="tiny-llama"} 384.0',
        'vllm:prefix_cache_hits_total{engine="1",model_name="tiny-llama"} 16.0',
        'vllm:prefix_cache_hits_created{engine="0",model_name="tiny-llama"} 1.7e+09',
        'kvbridge_router_kv_index_blocks{worker="p-a"} 3.0',
        'kvbridge_router_kv_index_blocks{worker="d \\"a\\""} 1.0',
        "plain_gauge 2.5 1700000000000",
    ])
    assert metric_sum(text, "vllm:prefix_cache_hits_total") == 400.0
    assert metric_by(text, "kvbridge_router_kv_index_blocks", "worker") == {"p-a": 3.0, 'd \\"a\\"': 1.0}
    assert metric_samples(text, "plain_gauge") == [({}, 2.5)]
    assert metric_samples(text, "vllm:prefix_cache") == []
