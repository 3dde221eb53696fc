#!/usr/bin/env bash
# Before/after in one lease on a 2-GPU device host: the control plane (kvbridge bench control, host CPU), the
# transceiver's direct path (bench/direct_gpu.py: 1 GiB requests TP2 -> TP1 and TP1 -> TP2 over cuda_ipc) and
# one READ end to end (bench/transfer_cuda.py, cuda_ipc only). From the repo root with $OUT set; carry .whl.
#   BASE=<folder holding the earlier tree as a package>  NEW=<this tree>   (default: .base/kvbridge and .)
# Each bench runs base then new, twice (alternated), so the ratios come from one machine in one lease.
set -u
export NCCL_NVLS_ENABLE=0 UCX_LOG_LEVEL=error NIXL_LOG_LEVEL=WARN PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
NEWSRC=$(realpath "${NEW:-.}") BASESRC=$(realpath "${BASE:-.base/kvbridge}")
mkdir -p /tmp/new /tmp/base && ln -sfn "$NEWSRC" /tmp/new/kvbridge && ln -sfn "$BASESRC" /tmp/base/kvbridge
DIRECT="$NEWSRC/bench/direct_gpu.py"  # the new tree's script drives either tree (absolute imports only)
R=/tmp/res && mkdir -p $R  # everything lands here and goes back as one tarball, refreshed after each step
keep() { tar -czf $OUT/res.tgz -C /tmp res; }
(nproc; nvidia-smi -L) | tee $R/env.txt
pp() { if [ "$1" = base ]; then echo /tmp/site:/tmp/base; else echo /tmp/site:/tmp/new; fi; }
for round in ${ROUNDS:-1 2}; do
  for side in base new; do
    echo "== round $round $side control"
    PYTHONPATH=$(pp $side) timeout 120 python3 -m kvbridge.bench control --gens ${GENS:-1,8} --requests 2000 \
      --window 64 --json $R/control_${side}_$round.json 2>&1 | tail -4; keep
  done
done
if [ -n "${CONTROL_VARIANTS:-}" ]; then  # new code only, e.g. "--no-read-ahead|--owner poll"
  IFS='|' read -ra VS <<< "$CONTROL_VARIANTS"
  for v in "${VS[@]}"; do
    echo "== new control $v"
    PYTHONPATH=$(pp new) timeout 120 python3 -m kvbridge.bench control --gens 1 --requests 2000 --window 64 $v 2>&1 | tail -2
  done
fi
if [ -n "${RECORD_GENS:-}" ]; then  # the run of record (bench/results/control.json): new code
  echo "== new control of record, gens $RECORD_GENS"
  PYTHONPATH=$(pp new) timeout 200 python3 -m kvbridge.bench control --gens $RECORD_GENS --requests 3000 --window 64 \
    --json $R/control.json 2>&1 | tail -6; keep
fi
if [ -n "${TRACE:-}" ]; then  # per-hop time stamps of one request at a time
  for side in base new; do
    echo "== $side control trace"
    PYTHONPATH=$(pp $side) timeout 90 python3 "$NEWSRC/bench/control_trace.py" --requests 300 2>&1 | tail -16 \
      | tee $R/trace_$side.txt; keep
  done
fi
for side in base new; do
  echo "== $side direct ($DIRECT)"
  PYTHONPATH=$(pp $side) timeout 200 python3 "$DIRECT" --requests ${REQUESTS:-3} --json $R/direct.jsonl 2>&1 | grep -v '^{'; keep
done
for opt in ${DIRECT_OPTIONS:-}; do
  echo "== new direct --option $opt"
  PYTHONPATH=$(pp new) timeout 200 python3 "$DIRECT" --requests ${REQUESTS:-3} --option $opt --json $R/direct.jsonl 2>&1 | grep -v '^{'; keep
done
for side in base new; do
  echo "== $side transfer_cuda"
  PYTHONPATH=$(pp $side) timeout 200 python3 -m kvbridge.bench.transfer_cuda --no-memcpy --agents cuda_ipc \
    --sizes ${SIZES:-4096,16384,65536,4194304} --reps 3 --json $R/transfer_$side.json 2>&1 | tail -12; keep
done
for pc in ${POST_CHUNKS:-}; do
  echo "== new transfer_cuda --post-chunk $pc"
  PYTHONPATH=$(pp new) timeout 200 python3 -m kvbridge.bench.transfer_cuda --no-memcpy --agents cuda_ipc \
    --sizes ${SIZES:-4096,16384,65536,4194304} --reps 3 --post-chunk $pc --json $R/transfer_new_pc$pc.json 2>&1 | tail -12; keep
done
echo done
