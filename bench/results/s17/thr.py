import json, sys, time
from kvbridge.bench import control as c
if __name__ == "__main__":
    n = int(sys.argv[1])
    rank = c._ContextRank(1, "nixl")
    try:
        rank.measure(300, 8, 120)
        rank.gen_timings(); g0, c0 = rank.gen_cpu_s, time.process_time()
        _, s = rank.measure(n, 64, 600)
        ctx = time.process_time() - c0
        rank.gen_timings(); gen = rank.gen_cpu_s - g0
    finally:
        end = rank.close()
    print(json.dumps({"req_per_s": round(n / s), "gen_cpu_us": round(gen / n * 1e6), "ctx_cpu_us": round(ctx / n * 1e6),
                      "ok": end["gen_failed"] == 0 and end["ctx_pinned_at_end"] == 0, "src": c.__file__}))
