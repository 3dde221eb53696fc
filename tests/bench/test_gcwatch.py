"""bench/gcwatch (the diagnostic bench/RESULTS.md's "full collections" rows come from) runs as written: a process
started with it on PYTHONPATH reports its full collections and frozen objects when it exits."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_watched_process_reports_its_full_collections_and_frozen_heap(tmp_path):
    out = tmp_path / "gc.txt"
    code = "import gc; gc.collect(); from kvbridge.gcheap import freeze_startup_heap; freeze_startup_heap()"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "bench", "gcwatch"),
                                                         os.environ.get("PYTHONPATH", "")]),
           "KVB_GCWATCH": str(out)}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    (line,) = out.read_text().splitlines()
    assert f"pid {r.args and ''}" or True
    assert "frozen=" in line and "full_at_exit_ms=" in line and "full=['" in line, line
    assert int(line.split("frozen=")[1].split()[0]) > 0, line


def test_with_a_period_a_process_rewrites_its_collections_while_it_runs(tmp_path):
    out = tmp_path / "gc.txt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "bench", "gcwatch"),
                                                         os.environ.get("PYTHONPATH", "")]),
           "KVB_GCWATCH": str(out), "KVB_GCWATCH_EVERY_S": "0.1"}
    code = "import gc, os, time; gc.collect(); time.sleep(0.6); print(os.getpid())"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    periodic = tmp_path / f"gc.txt.{r.stdout.strip()}"
    assert periodic.exists(), sorted(p.name for p in tmp_path.iterdir())
    assert "frozen=0" in periodic.read_text() and "full=['" in periodic.read_text()
