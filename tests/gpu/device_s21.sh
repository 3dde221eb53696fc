#!/usr/bin/env bash
# Session 21 (issue 24, control plane): where a one-at-a-time request's time goes on a GPU host. The bare hops
# after an idle pause (control_floor --idle-us: what waking an idle thread and core costs there), the per-hop
# trace, then `kvbridge bench control --gens 1`. The host's CPU idle states and governor (read only, where its
# sysfs has them) in $OUT/env.txt. From the repo root with $OUT set;
# carry .whl and .whl-serving.
set -u
. tests/gpu/device_prelude.sh
{ cat /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor 2>&1
  for s in /sys/devices/system/cpu/cpu0/cpuidle/state*; do echo "$(cat $s/name) latency $(cat $s/latency) us"; done
} >> $OUT/env.txt 2>&1
cat $OUT/env.txt
for idle in ${IDLES:-0 500 2000}; do
  echo "== $SECONDS s: floor idle $idle"
  timeout 120 python3 -m kvbridge.bench.control_floor --rounds 1000 --idle-us $idle --json $OUT/floor_idle$idle.json \
    2>&1 | tail -6
done
echo "== $SECONDS s: trace"
timeout 120 python3 -m kvbridge.bench.control_trace --requests 500 2>&1 | tail -16 | tee $OUT/trace.txt
echo "== $SECONDS s: control"
timeout 150 python3 -m kvbridge.bench control --gens 1 --requests 2000 --window 64 --json $OUT/control.json 2>&1 | tail -3
