"""kvbridge's own long-running processes freeze their startup heap (gcheap.py): a full collection then walks
only what was allocated since, not the ~200k objects of torch, the model and the server (80-270 ms per
collection in `kvbridge demo`'s processes before, stopping the transceiver's I/O thread with every other).
Run in child processes: freezing would keep this test process's objects for its life."""

from __future__ import annotations

import json
import os
import subprocess
import sys

CHILD = """
import gc, json
import torch  # the bulk of a rank's heap
from kvbridge.gcheap import freeze_startup_heap
n = freeze_startup_heap()
gc.collect()  # a full collection afterwards leaves the frozen objects frozen
print(json.dumps({"returned": n, "frozen": gc.get_freeze_count()}))
"""


def _child(env_value: str | None) -> dict:
    env = dict(os.environ)
    env.pop("KVBRIDGE_GC_FREEZE", None)
    if env_value is not None:
        env["KVBRIDGE_GC_FREEZE"] = env_value
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_startup_heap_is_frozen_and_stays_frozen_unless_turned_off():
    got = _child(None)
    assert got["returned"] == got["frozen"] > 50_000, got  # torch alone is ~100k tracked objects
    off = _child("0")
    assert off["returned"] == off["frozen"] == 0, off
