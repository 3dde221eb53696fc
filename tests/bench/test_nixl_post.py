"""docs/control-plane.md's `python -m kvbridge.bench.nixl_post`: runs as printed, every READ copies the peer's
bytes, and the row and its plot are written (its numbers: bench/RESULTS.md, "Session 10")."""

from __future__ import annotations

import json
import subprocess
import sys


def test_nixl_post_quick(tmp_path):
    out = tmp_path / "post.json"
    p = subprocess.run([sys.executable, "-m", "kvbridge.bench.nixl_post", "--reads", "50", "--json", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["verified"] is True and row["reads"] == 50
    for key in ("nixl_descs_us", "nixl_init_us", "nixl_post_us", "nixl_prepped_us", "kvbridge_read_us"):
        assert row[key] > 0, row
    assert (tmp_path / "post.png").exists()
