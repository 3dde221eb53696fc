#!/usr/bin/env bash
# Issue 24, session 6: two questions for the GPU host, one lease.
#  1. The control plane is slower on the 32-core GPU host than on the 2-core box (wake-ups across idle cores?):
#     `kvbridge bench control` with the processes unpinned and pinned to a few cores (taskset; children and
#     their threads inherit it), alternated.
#  2. TP1 -> TP2 on two GPUs: two generation processes share GPU0 and their copy kernels take turns (no MPS).
#     The direct path with the cuda_ipc agent (SM kernels) against NIXL (UCX cuda_ipc: copy engines), alternated.
#   run(command="bash tests/gpu/device_pin9.sh", carry=[".whl"], kind="nvidia-h100-x2")
# Knobs: PINS (default "none 0,1 0-3 0-7"), ROUNDS ("1 2"), SPLITS ("1:2,2:1"), DIRECT (1; empty: skip part 2).
set -u
export UCX_LOG_LEVEL=error NIXL_LOG_LEVEL=WARN PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
W=${WORK:-/tmp/kvb-pin9} && rm -rf $W && mkdir -p $W/pkg/kvbridge
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $W/site .whl/*.whl || exit 3
cp -r $(ls -A | grep -v -x -e .whl -e .whl-serving -e .git -e .venv -e .venv-vllm -e '.dev-.*') $W/pkg/kvbridge/
export PYTHONPATH=$W/site:$W/pkg
{
  nproc; uptime; nvidia-smi -L; lscpu | grep -E 'Model name|Socket|NUMA|Thread|Core'
  for s in /sys/devices/system/cpu/cpu0/cpuidle/state*; do
    echo "cpuidle $(cat $s/name 2>/dev/null) latency_us=$(cat $s/latency 2>/dev/null) disabled=$(cat $s/disable 2>/dev/null)"
  done
  echo "governor $(cat /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor 2>/dev/null)"
} 2>&1 | tee $OUT/env.txt
cd /tmp
for round in ${ROUNDS:-1 2}; do
  for pin in ${PINS:-none 0,1 0-3 0-7}; do
    pre=""; [ "$pin" != none ] && pre="taskset -c $pin"
    tag=${pin//,/_}
    echo "== round $round pin $pin: control --gens 1"
    timeout 150 $pre python3 -m kvbridge.bench control --gens 1 --requests 2000 --window 64 \
      --json $OUT/control_pin${tag}_$round.json 2>&1 | tail -3
  done
done
echo "== pinned 0-3: control of record --gens 1,8,64"
timeout 240 taskset -c 0-3 python3 -m kvbridge.bench control --gens 1,8,64 --requests 3000 --window 64 \
  --json $OUT/control_pin0-3_record.json 2>&1 | tail -6
if [ -n "${DIRECT-1}" ]; then
  for round in 1 2; do
    for agent in cuda_ipc nixl; do
      echo "== round $round direct_gpu $agent ${SPLITS:-1:2,2:1}"
      timeout 200 python3 -m kvbridge.bench.direct_gpu --agent $agent --splits ${SPLITS:-1:2,2:1} --requests 5 \
        --json $OUT/direct_${agent}_$round.jsonl 2>&1 | tail -4
    done
  done
fi
cd $OUT && tar czf pin9.tgz *.json *.jsonl env.txt 2>/dev/null; ls $OUT
echo done
