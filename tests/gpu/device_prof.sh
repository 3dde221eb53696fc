#!/usr/bin/env bash
# Where the generation rank's time goes at 64 requests in flight (bench/control.py's throughput phase, one context
# rank, one generation rank, NIXL on loopback): py-spy --gil on the generation process for 5 s and its threads' CPU
# from /proc, twice. From the repo root with $OUT set; carry .whl (with tools/py-spy, a static binary) and
# .whl-serving: run(command="bash tests/gpu/device_prof.sh", carry=[".whl", ".whl-serving"], kind="nvidia-h100-x2")
set -u
source tests/gpu/device_prelude.sh
R=/tmp/prof && mkdir -p $R
cat > $R/thr.py <<'PY'
import json, sys, time
from kvbridge.bench import control as c
if __name__ == "__main__":
    n = int(sys.argv[1])
    rank = c._ContextRank(1, "nixl")
    try:
        rank.measure(300, 8, 120)
        rank.gen_timings(); g0, c0 = rank.gen_cpu_s, time.process_time()
        print("GENPID", rank.procs[0].pid, flush=True)
        _, s = rank.measure(n, 64, 600)
        ctx = time.process_time() - c0
        rank.gen_timings(); gen = rank.gen_cpu_s - g0
    finally:
        end = rank.close()
    print(json.dumps({"req_per_s": round(n / s), "gen_cpu_us": round(gen / n * 1e6), "ctx_cpu_us": round(ctx / n * 1e6),
                      "ok": end["gen_failed"] == 0 and end["ctx_pinned_at_end"] == 0}))
PY
PYSPY=$OLDPWD/.whl/tools/py-spy  # a static py-spy binary, carried in the ignored .whl/
[ -x $PYSPY ] || PYSPY=/tmp/pkg/kvbridge/.whl/tools/py-spy
ls -la $PYSPY
for i in 1 2; do
  timeout 200 python3 $R/thr.py 60000 > $R/thr_$i.txt 2>&1 &
  TP=$!
  for k in $(seq 1 100); do grep -q GENPID $R/thr_$i.txt 2>/dev/null && break; sleep 0.2; done
  GP=$(grep GENPID $R/thr_$i.txt | awk '{print $2}')
  sleep 3
  # per-thread CPU of the generation process over 4 s
  for t in /proc/$GP/task/*; do echo "$(basename $t) $(cat $t/comm) $(awk '{print $14+$15}' $t/stat)"; done > $R/threads_a_$i.txt
  timeout 30 $PYSPY record --nonblocking --gil -r 1000 -d 5 -f raw -o $OUT/prof_gil_$i.txt -p $GP > $R/pyspy_$i.log 2>&1
  for t in /proc/$GP/task/*; do echo "$(basename $t) $(cat $t/comm) $(awk '{print $14+$15}' $t/stat)"; done > $R/threads_b_$i.txt
  timeout 30 $PYSPY record --nonblocking --idle -r 500 -d 3 -f raw -o $OUT/prof_all_$i.txt -p $GP >> $R/pyspy_$i.log 2>&1
  wait $TP
  tail -1 $R/thr_$i.txt
  tail -2 $R/pyspy_$i.log
  join $R/threads_a_$i.txt $R/threads_b_$i.txt 2>/dev/null | awk '{print $1, $2, $5-$3}' | sort -k3 -n -r | head -12 > $OUT/threads_$i.txt
  cat $OUT/threads_$i.txt
done
cp $R/*.txt $OUT/ 2>/dev/null
echo done
