#!/usr/bin/env bash
# Issue 24's kernel-only sweep on a 2-GPU host (bench/RESULTS.md, "Fragment-copy kernel sweep"). With $OUT set;
# run from any folder (the tree is this script's ../..); carry .whl for step 4 (pyzmq, nixl wheels):
#   1. bench/kernel_sweep.py --only sm: today's kernel and its SM variants, uniform + misaligned layouts
#   2. --only tma: Hopper bulk copies (cp.async.bulk peer -> shared -> local), pull and push
#   3. --only extras: the copy engine on scattered fragments (cuMemcpyBatchAsync), alone, beside the kernel
#      (aggregate), and one transfer split between them (bench/kernel_sweep_ce.py)
#   4. kvbridge.bench.transfer_cuda --no-memcpy --agents cuda_ipc: one READ end to end, this tree as it is
#   5. lb4 (__launch_bounds__(256, 4), spills) under compute-sanitizer, 64 MiB (it faulted in the first sweep)
# Eight files come back under $OUT at most: sweep.jsonl, extras.jsonl, transfer.json and one .txt per step.
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 UCX_LOG_LEVEL=error NIXL_LOG_LEVEL=WARN KVBRIDGE_CACHE_DIR=/tmp/kvbc
TREE=$(realpath "$(dirname "$0")/../..")
WHL=${WHL:-$PWD/.whl}
cd "$TREE" || exit 9
J=$OUT/sweep.jsonl
t() { local s=$SECONDS; timeout "$@"; echo "== rc=$? $((SECONDS - s))s: ${*:2:5}"; }
nvidia-smi -L
t ${SM_S:-180} python3 bench/kernel_sweep.py --only sm --skip lb4,u16_lb3 --json $J > $OUT/sm.txt 2>&1
t ${TMA_S:-90} python3 bench/kernel_sweep.py --only tma --layouts uniform --json $J > $OUT/tma.txt 2>&1
t ${CE_S:-120} python3 bench/kernel_sweep.py --only extras --json $OUT/extras.jsonl > $OUT/extras.txt 2>&1
if ls "$WHL"/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHL"/*.whl
  mkdir -p /tmp/pp && ln -sfn "$TREE" /tmp/pp/kvbridge
  PYTHONPATH=/tmp/site:/tmp/pp t ${READ_S:-120} python3 -m kvbridge.bench.transfer_cuda --no-memcpy --agents cuda_ipc \
    --sizes 4096,16384,65536 --reps 3 --json $OUT/transfer.json > $OUT/transfer.txt 2>&1
fi
t ${SAN_S:-45} compute-sanitizer --print-limit 3 python3 bench/kernel_sweep.py --only lb4 --sizes 4096 \
  --layouts uniform --total-mib 64 --reps 1 > $OUT/lb4.txt 2>&1
# the short tables: ours, then the end-to-end READ
grep -E "^# |pull|push" $OUT/sm.txt | awk '{printf "%-22s %-4s %-7s %6s %7s %8s\n", $1, $2, $3, $4, $5, $6}' | head -120
grep -vE "^\{" $OUT/extras.txt | head -40
tail -8 $OUT/transfer.txt 2>/dev/null
grep -E "ERROR|Invalid|at 0x|by thread|ERROR SUMMARY" $OUT/lb4.txt | head -8
