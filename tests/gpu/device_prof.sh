#!/usr/bin/env bash
# Where the generation rank's time goes at 64 requests in flight (bench/control.py's throughput phase, one
# context rank, one generation rank, NIXL on loopback; tests/gpu/control_throughput.py): py-spy --gil on the
# generation process for 5 s and its threads' CPU from /proc over those 5 s, twice. From the repo root with
# $OUT set; carry .whl (with tools/py-spy, a static binary) and .whl-serving:
#   run(command="bash tests/gpu/device_prof.sh", carry=[".whl", ".whl-serving"], kind="nvidia-h100-x2")
set -u
source tests/gpu/device_prelude.sh  # (cd's into a copy of the tree without .whl: py-spy stays at $OLDPWD)
R=/tmp/prof && mkdir -p $R
PYSPY=$OLDPWD/.whl/tools/py-spy
ticks() {  # "tid name utime+stime" of every thread of process $1
  for t in /proc/$1/task/*; do echo "$(basename $t) $(cat $t/comm) $(awk '{print $14+$15}' $t/stat)"; done
}
for i in 1 2; do
  timeout 200 python3 tests/gpu/control_throughput.py 60000 > $R/thr_$i.txt 2>&1 &
  TP=$!
  for k in $(seq 1 100); do grep -q GENPID $R/thr_$i.txt 2>/dev/null && break; sleep 0.2; done
  GP=$(grep GENPID $R/thr_$i.txt | awk '{print $2}')
  sleep 3
  ticks $GP > $R/threads_a_$i.txt
  timeout 30 $PYSPY record --nonblocking --gil -r 1000 -d 5 -f raw -o $OUT/prof_gil_$i.txt -p $GP \
    > $R/pyspy_$i.log 2>&1
  ticks $GP > $R/threads_b_$i.txt
  timeout 30 $PYSPY record --nonblocking --idle -r 500 -d 3 -f raw -o $OUT/prof_all_$i.txt -p $GP \
    >> $R/pyspy_$i.log 2>&1
  wait $TP
  tail -1 $R/thr_$i.txt
  tail -2 $R/pyspy_$i.log
  join $R/threads_a_$i.txt $R/threads_b_$i.txt 2>/dev/null | awk '{print $1, $2, $5-$3}' | sort -k3 -n -r \
    | head -12 > $OUT/threads_$i.txt
  cat $OUT/threads_$i.txt
  cp $R/thr_$i.txt $OUT/
done
echo done
