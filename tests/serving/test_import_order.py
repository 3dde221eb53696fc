"""A worker turns on prometheus_client's multiprocess mode before anything imports prometheus_client (the
value class is chosen at import time); what it imports first must not pull it in, or the worker's own
metrics never reach /metrics (only its rank processes' would)."""

from __future__ import annotations

import subprocess
import sys


def test_the_worker_entry_imports_neither_prometheus_nor_the_transceiver_before_its_metrics_are_set_up():
    code = ("import sys; import kvbridge.serving.launcher, kvbridge.serving.metrics, kvbridge.serving.auth; "
            "print(sorted(m for m in ('prometheus_client', 'kvbridge.transceiver') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
