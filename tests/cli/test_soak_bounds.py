"""Issue 27: `kvbridge bench soak` does the work its flags ask for, no more: --frames frames into the decoder
in all (valid, mutated, oversized, bombs), --live-frames into the live rank, --live-requests real pulls at
most, and part B off with --requests 0. (--no-bombs: the expansion bombs are slow
enough on a loaded machine to count as hangs, which is the soak's verdict, not this test's subject.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_soak_honours_its_bounds(tmp_path):
    out = tmp_path / "soak.json"
    args = ["--frames", "200", "--live-frames", "100", "--live-requests", "4", "--requests", "0",
            "--no-bombs", "--json", str(out)]
    p = subprocess.run([sys.executable, "-m", "kvbridge.cli", "bench", "soak", *args], cwd=tmp_path,
                       capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stdout + p.stderr
    d = json.loads(out.read_text())
    assert sum(r["frames"] for r in d["decoder"]["rows"]) == 200
    assert d["live"]["hammer"]["sent"] == 100
    assert d["live_requests"] == 4 and d["requests"] == 0
    assert d["frames"] == 300
