"""`kvbridge check-agent` as a user runs it: a subprocess, its pass/fail table and its exit code.

The example agent passes every check; deliberately broken agents (tests/agents/broken_agents.py) fail with
the check that names their fault, and the exit code says so.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BROKEN = "tests.agents.broken_agents"


def check_agent(*args: str) -> tuple[int, dict[str, str], str]:
    """Run the CLI from the checkout's root; (exit code, {check: PASS/FAIL}, whole output)."""
    proc = subprocess.run([sys.executable, "-m", "kvbridge.cli", "check-agent", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=280)
    rows = dict(re.findall(r"^  ([a-z-]+)\s+(PASS|FAIL|NOT RUN)\b", proc.stdout, re.M))
    return proc.returncode, rows, proc.stdout + proc.stderr


@pytest.mark.slow
def test_the_example_agent_passes_every_check_with_exit_code_0():
    from kvbridge.agents.conformance import CHECKS

    code, rows, out = check_agent("examples.custom_agent:CmaAgent")
    assert code == 0, out
    assert rows == {c.name: "PASS" for c in CHECKS}, out
    assert f"{len(CHECKS)} of {len(CHECKS)} checks passed" in out


def test_wrong_bytes_fail_the_read_checks_by_name():
    code, rows, out = check_agent(f"{BROKEN}:WrongBytesAgent", "--only", "read-many-fragments,read-large,"
                                  "write-many-fragments")
    assert code == 1, out
    assert rows == {"read-many-fragments": "FAIL", "write-many-fragments": "PASS", "read-large": "FAIL"}, out
    assert re.search(r"read-many-fragments\s+FAIL.*1 bytes differ, first at offset", out), out


def test_a_handle_that_never_completes_fails_status_and_wait_by_its_deadline():
    code, rows, out = check_agent(f"{BROKEN}:NeverCompletesAgent", "--timeout", "2",
                                  "--only", "read-large,status-and-wait")
    assert code == 1, out
    assert rows == {"read-large": "FAIL", "status-and-wait": "FAIL"}, out
    assert "still PENDING after wait(2)" in out and "failed: read-large, status-and-wait" in out


def test_a_read_that_ignores_cancel_fails_the_cancel_check():
    code, rows, out = check_agent(f"{BROKEN}:IgnoresCancelAgent", "--only", "read-large,cancel")
    assert code == 1, out
    assert rows == {"read-large": "PASS", "cancel": "FAIL"}, out
    assert "yet it ended DONE (must end FAILED)" in out


def test_unknown_check_names_are_refused_with_exit_code_2():
    code, rows, out = check_agent("examples.custom_agent:CmaAgent", "--only", "no-such-check")
    assert code == 2 and not rows
    assert "unknown check(s) no-such-check" in out and "read-many-fragments" in out


def test_a_class_that_cannot_be_loaded_fails_setup_once_naming_why():
    code, rows, out = check_agent("no_such_module_xyz:Agent", "--only", "read-large")
    assert code == 1 and rows == {"setup": "FAIL", "read-large": "NOT RUN"}, out
    assert "not run: setup failed" in out and "no_such_module_xyz" in out


def test_vram_without_a_gpu_is_refused_with_the_reason():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the refusal is for machines without one")
    code, rows, out = check_agent("examples.custom_agent:CmaAgent", "--memory", "vram")
    assert code == 2 and not rows
    assert "--memory vram needs a CUDA GPU" in out
