"""bench/direct_host.py (the direct path's plan and post host work, CUDA stubbed) runs on CPU and reports
every case; the GPU script that runs it before the GPU steps passes `bash -n`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_direct_host_reports_every_shape_with_the_grid_path(tmp_path):
    out = tmp_path / "rows.jsonl"
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "direct_host.py"), "--requests", "3",
                    "--json", str(out)], check=True, timeout=240, capture_output=True)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    cases = [r["case"] for r in rows]
    assert cases.count("ctx TP1 -> gen TP2") == 2 and cases.count("ctx TP2 -> gen TP1") == 1
    assert sum(c.startswith("one READ") for c in cases) == 4
    for r in rows:
        assert r["first_launch_ms"] > 0 and r["post_ms"] > 0
    tp21 = next(r for r in rows if r["case"] == "ctx TP2 -> gen TP1")
    assert tp21["fragments"] == 65536 and tp21["legs"] == 2


def test_the_gpu_script_parses():
    subprocess.run(["bash", "-n", os.path.join(ROOT, "tests", "gpu", "device_direct.sh")], check=True, timeout=30)
