"""The soak's part B, short: 200 requests through a TP2 context-only and a PP2 generation-only executor (real
rank processes, ZeroMQ, NIXL) with client aborts, context requests left to expire and one restart of the
generation executor with requests in flight. Nothing may be lost, leaked or corrupted; the full run is
`kvbridge bench soak` (bench/soak.py)."""

from __future__ import annotations

from kvbridge.bench.soak_requests import RequestSoak


def test_200_requests_with_aborts_expiries_and_a_restart_lose_leak_and_corrupt_nothing(tmp_path):
    out = RequestSoak(200, seed=7, run_dir=str(tmp_path), concurrency=16).run()
    assert out["requests"] == 200
    assert out["lost"] == 0 and out["stuck_clients"] == 0, out["errors"]
    assert out["leaked_blocks"] == 0, out["errors"]
    assert out["corrupted"] == 0, out["corrupted_prompts"]
    assert out["failed"] == 0, out["errors"]  # every end is a completion, an abort, an expiry or the restart
    assert out["restarts"] == 1
    assert out["aborted"] > 0 and out["expired"] > 0 and out["completed"] > 120
    assert (out["completed"] + out["aborted"] + out["expired"] + out["restart_failed"]) == 200
