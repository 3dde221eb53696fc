"""A diagnostic: every Python process started with this folder first on PYTHONPATH and KVB_GCWATCH=<file> appends
one line to <file> when it exits: its pid, how many objects gc.freeze holds, and each full (generation 2)
collection as `seconds since start:milliseconds it took:objects tracked`, and what one more full collection costs it
at exit (`full_at_exit_ms`: the price of a full collection once it served). Children inherit the environment,
so one command watches a whole deployment:

    PYTHONPATH=$PWD/bench/gcwatch KVB_GCWATCH=/tmp/gc.txt .venv/bin/kvbridge demo

(from the repo root; KVBRIDGE_GC_FREEZE=0 beside it shows the same without kvbridge's heap freeze, gcheap.py).
Explicit gc.collect() calls are listed too. A process stopped by a signal runs no exit hook (vLLM's engine and
workers): KVB_GCWATCH_EVERY_S=<s> also rewrites `<file>.<pid>` with its collections so far every <s> seconds.
Not part of kvbridge: nothing imports it.
"""

import os

if os.environ.get("KVB_GCWATCH"):
    import atexit
    import gc
    import sys
    import time

    _T0 = time.perf_counter()
    _start: list[float] = []
    _full: list[str] = []

    def _on_gc(phase, info):
        if phase == "start":
            _start[:] = [time.perf_counter()]
        elif _start and info["generation"] == 2:
            took = (time.perf_counter() - _start[0]) * 1e3
            _full.append(f"{_start[0] - _T0:.1f}s:{took:.0f}ms:{len(gc.get_objects())}")

    def _line() -> str:
        who = " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]])[:90] if sys.argv else "?"
        return f"pid {os.getpid()} {who!r} frozen={gc.get_freeze_count()}"

    def _every(period: float) -> None:
        path = f"{os.environ['KVB_GCWATCH']}.{os.getpid()}"
        while True:
            time.sleep(period)
            with open(path + ".tmp", "w") as f:  # then renamed: a process ending mid-write leaves the last whole one
                f.write(f"{_line()} full={_full}\n")
            os.replace(path + ".tmp", path)

    def _report():
        t = time.perf_counter()
        gc.collect()  # one more, timed: what a full collection costs this process as it is now
        last = (time.perf_counter() - t) * 1e3
        with open(os.environ["KVB_GCWATCH"], "a") as f:
            f.write(f"{_line()} full_at_exit_ms={last:.1f} full={_full[:-1]}\n")  # less the timed one

    gc.callbacks.append(_on_gc)
    atexit.register(_report)
    if float(os.environ.get("KVB_GCWATCH_EVERY_S") or 0) > 0:
        import threading

        threading.Thread(target=_every, args=(float(os.environ["KVB_GCWATCH_EVERY_S"]),), daemon=True).start()
