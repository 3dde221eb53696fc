"""`kvbridge bench vllm-cells` on one cell (TP1 -> TP1, block 32) with real vLLM servers, both connectors: the
bench runs end to end through the CLI, writes a row per connector, classifies KVBridgeConnector's answers as
exact (tokens, logprobs and every block's KV), classifies NixlConnector's without breaking, and leaves no
server behind. The whole sweep (every cell) is run by hand: bench/RESULTS.md has its command and table."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .conftest import needs_vllm

pytestmark = [needs_vllm, pytest.mark.slow, pytest.mark.timeout(900)]


def test_the_tp1_cell_runs_both_connectors_and_kvbridge_is_exact(tmp_path):
    out, logs = tmp_path / "cells.json", tmp_path / "logs"
    r = subprocess.run([sys.executable, "-m", "kvbridge.bench", "vllm-cells", "--cells", "tp1-tp1", "--lens", "16",
                        "300", "--no-doc", "--json", str(out), "--log-dir", str(logs)],
                       check=False, capture_output=True, text=True, timeout=850, env=dict(os.environ))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {x["connector"]: x for x in json.loads(out.read_text())}
    assert set(rows) == {"nixl", "kvbridge"}, rows
    for x in rows.values():
        assert {"cell", "connector", "outcome", "detail", "prompts", "seconds"} <= set(x), x
        assert x["cell"] == "TP1 -> TP1, block 32"
        assert not x["outcome"].startswith("error"), f"the bench could not run {x['connector']}: {x}"
    kvb = rows["kvbridge"]
    assert kvb["outcome"] == "exact" and kvb["prompts"] == 2, kvb
    assert all("KV equal position by position" in p["detail"] for p in kvb["per_prompt"]), kvb
    assert "tp1-tp1-nixl-d.log" in os.listdir(logs) and "aggregated.log" in os.listdir(logs)
    ports = {int(f.read_text().split("--port ", 1)[1].split()[0]) for f in logs.glob("*.log")}
    assert len(ports) == 5 and not ports & listening(), "a vLLM server of the bench still listens"


def listening() -> set[int]:
    """Every TCP port something listens on here (/proc/net/tcp, state 0A)."""
    out = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(name) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":
                    out.add(int(fields[1].rsplit(":", 1)[1], 16))
    return out
