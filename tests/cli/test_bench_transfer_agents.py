"""Issue 27: `kvbridge bench transfer --agents MODULE:CLASS` finds a module in the working directory (as
check-agent does), and fails at once, non-zero, with the peer's traceback when its peer cannot start."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def bench(tmp_path, agents: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvbridge.cli", "bench", "transfer", "--agents", agents,
                           "--sizes", "16K", "--total", "1M", "--repeat", "1"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=200)


def test_a_module_in_the_working_directory_is_found_and_measured(tmp_path):
    shutil.copy(os.path.join(ROOT, "examples", "custom_agent.py"), tmp_path / "mycma.py")
    p = bench(tmp_path, "mycma:CmaAgent")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "CmaAgent" in p.stdout and "True" in p.stdout, p.stdout


def test_a_peer_that_dies_at_import_fails_fast_with_its_traceback(tmp_path):
    (tmp_path / "dies.py").write_text("raise RuntimeError('this agent module fails at import on purpose')\n")
    t0 = time.monotonic()
    p = bench(tmp_path, "dies:Agent")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "FAILED" in p.stderr and "fails at import on purpose" in p.stderr, p.stderr
    assert time.monotonic() - t0 < 100  # not the 120 s start deadline
