"""bench/control.py's throughput phase alone, for the device scripts (device_ctl14.sh, device_prof.sh): one
context rank, one generation rank (NIXL on loopback), a 300-request warm-up, then N requests at 64 in flight.
Prints `GENPID <pid>` (the generation process, for a profiler) once warm, then one JSON line: requests/s and
each side's CPU per request. Runs against whichever kvbridge is on PYTHONPATH (a base tree or this one).

    python3 tests/gpu/control_throughput.py 20000
"""

import json
import sys
import time

from kvbridge.bench import control as c

if __name__ == "__main__":
    n = int(sys.argv[1])
    rank = c._ContextRank(1, "nixl")
    try:
        rank.measure(300, 8, 120)
        rank.gen_timings()
        g0, c0 = rank.gen_cpu_s, time.process_time()
        print("GENPID", rank.procs[0].pid, flush=True)
        _, s = rank.measure(n, 64, 600)
        ctx = time.process_time() - c0
        rank.gen_timings()
        gen = rank.gen_cpu_s - g0
    finally:
        end = rank.close()
    print(json.dumps({"req_per_s": round(n / s), "gen_cpu_us": round(gen / n * 1e6),
                      "ctx_cpu_us": round(ctx / n * 1e6),
                      "ok": end["gen_failed"] == 0 and end["ctx_pinned_at_end"] == 0}))
