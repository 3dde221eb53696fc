"""The garbage collector in kvbridge's own long-running processes (like errors.py and codec.py, below all
packages; imports nothing of kvbridge).

Python's full collection walks every object the process holds. A serving worker holds ~200k of them once torch,
the model and the server are loaded, and a full collection of those took 80-270 ms on the 2-core box (`kvbridge
demo`'s processes; 36-40 ms for torch + the transceiver alone), stopping every thread, the transceiver's I/O thread
included: a request in flight then waits that long. Once a process is ready to serve, `freeze_startup_heap`
collects once and moves what is alive into the permanent generation (`gc.freeze`, as vLLM's engine core does), so
later collections walk only what was allocated since. Objects freed by reference counting are freed as before;
only reference cycles among the frozen objects are never collected (startup state, kept for the process's life
anyway). KVBRIDGE_GC_FREEZE=0 turns it off.
"""

from __future__ import annotations

import gc
import os

__all__ = ["freeze_startup_heap"]


def freeze_startup_heap() -> int:
    """Collect, then freeze every object alive now; returns how many are frozen (0 when KVBRIDGE_GC_FREEZE=0)."""
    if os.environ.get("KVBRIDGE_GC_FREEZE", "1").strip() == "0":
        return 0
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
