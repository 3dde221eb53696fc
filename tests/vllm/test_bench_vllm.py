"""`kvbridge bench vllm --quick`: aggregated vLLM, vLLM + NixlConnector and vLLM + KVBridgeConnector run on
the same prompts, every row is written, and every disaggregated answer has the aggregated tokens. Speed is not
checked here (bench/RESULTS.md has the measured numbers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .conftest import needs_vllm

pytestmark = [needs_vllm, pytest.mark.slow, pytest.mark.timeout(1800)]


def test_the_quick_bench_writes_every_row_with_identical_tokens(tmp_path):
    out = tmp_path / "vllm.json"
    r = subprocess.run([sys.executable, "-m", "kvbridge.cli", "bench", "vllm", "--quick", "--json", str(out),
                        "--log-dir", str(tmp_path / "logs")], capture_output=True, text=True, timeout=1700,
                       env=dict(os.environ))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert (tmp_path / "vllm.png").exists()
    assert {(x["connector"], x["prompt_tokens"]) for x in rows} == {
        (c, n) for c in ("aggregated", "nixl", "kvbridge", "kvbridge_early") for n in (128, 512)}
    keys = {"connector", "prompt_tokens", "ttft_p50_ms", "ttft_p90_ms", "transfer_ms_p50", "kv_bytes",
            "req_per_s", "tokens_identical"}
    for x in rows:
        assert keys <= set(x) and x["tokens_identical"] is True, x
        assert x["ttft_p50_ms"] > 0 and x["req_per_s"] > 0
        if x["connector"] != "aggregated":  # the KV really moved, at least the prompt's worth
            assert x["kv_bytes"] >= x["prompt_tokens"] * 2 * 4 * 2 * 32 * 4
            assert x["transfer_ms_p50"] is not None
