#!/usr/bin/env bash
# Issue 24's direct path, before/after in one lease on a 2-GPU host (bench/RESULTS.md, "Direct path host work
# (issue 24, session 3)"). From the repo root with $OUT set; carry .whl:
#   BASE=<folder holding the earlier tree as a package (main)>  NEW=<this tree>   (default: .base/kvbridge and .)
# Steps, base and new alternated (each step's rows under $OUT/direct/):
#   1. bench/direct_host.py: the plan + post host work on this host's CPU (CUDA stubbed; seconds)
#   2. bench/direct_gpu.py: 1 GiB requests through the transceiver, ctx TP2 -> gen TP1 and TP1 -> gen TP2
#   3. kvbridge.bench.transfer_cuda --no-memcpy --agents cuda_ipc: one READ end to end, $SIZES fragments
#   4. new with side_upload=false (direct, then transfer): the side-stream upload's share; new transfer with
#      --post-chunk $POST_CHUNKS (default 65536: fewer, larger pipelined kernels)
#   5. with TESTS=1: the GPU tests of what changed (the cuda_ipc agent, the transceiver on GPUs)
# A step starts only with 30 s of the $HARD-second budget left (default 340) and is cut at the budget, so the
# run ends within ~6 minutes whatever a step does; skipped steps are listed in $OUT/direct/skipped.txt.
# DRY=1: a CPU rehearsal (this venv's python, no wheels; step 1, and step 2 with host pools over NIXL).
set -u
export NCCL_NVLS_ENABLE=0 UCX_LOG_LEVEL=error NIXL_LOG_LEVEL=WARN PYTHONUNBUFFERED=1 KVBRIDGE_CACHE_DIR=/tmp/kvbc
PY=python3
if [ -n "${DRY:-}" ]; then
  PY=${PYTHON:-python3}
  SITE=""
else
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
  SITE=/tmp/site:
fi
NEWSRC=$(realpath "${NEW:-.}") BASESRC=$(realpath "${BASE:-.base/kvbridge}")
T=${TMPDIR:-/tmp}/kvb-direct.$$ && mkdir -p $T/new $T/base && ln -sfn "$NEWSRC" $T/new/kvbridge && ln -sfn "$BASESRC" $T/base/kvbridge
D=$OUT/direct && mkdir -p $D
pp() { echo "${SITE}$T/$1"; }
SIDES=${SIDES:-base new}
SIZES=${SIZES:-4096,16384,65536}
HARD=${HARD:-340}
left() { if [ $((HARD - SECONDS)) -ge 30 ]; then return 0; fi; echo "== skipped (${SECONDS}s of ${HARD}s used): $*" | tee -a $D/skipped.txt; return 1; }
tmo() { local t=$((HARD - SECONDS)); [ $t -gt $1 ] && t=$1; echo $t; }  # a step's timeout: at most $1, within budget
(nproc; nvidia-smi -L 2>&1; date -u) | tee $D/env.txt

for side in $SIDES; do  # 1. host work (CPU only)
  left "host $side" || break
  echo "== $side direct_host"
  PYTHONPATH=$(pp $side) timeout $(tmo 60) $PY "$NEWSRC/bench/direct_host.py" --requests 30 --label $side \
    --json $D/direct_host.jsonl 2>&1 | tail -8
done

if [ -n "${DRY:-}" ]; then  # CPU rehearsal of step 2's plumbing: host pools, NIXL, one split, new tree only
  echo "== new direct_gpu --cpu (dry)"
  PYTHONPATH=$(pp new) timeout 240 $PY "$NEWSRC/bench/direct_gpu.py" --cpu --agent nixl --splits 2:1 --requests 2 \
    --json $D/direct_gpu_dry.jsonl 2>&1 | grep -v '^{'
  echo done; rm -rf $T; exit 0
fi

for round in ${ROUNDS:-1}; do
  for side in $SIDES; do  # 2. the transceiver's direct path
    left "direct $side round $round" || break
    echo "== round $round $side direct_gpu"
    PYTHONPATH=$(pp $side) timeout $(tmo 150) $PY "$NEWSRC/bench/direct_gpu.py" --requests ${REQUESTS:-3} \
      --json $D/direct_gpu_${side}.jsonl 2>&1 | grep -v '^{'
  done
  for side in $SIDES; do  # 3. one READ end to end
    left "transfer $side round $round" || break
    echo "== round $round $side transfer_cuda"
    PYTHONPATH=$(pp $side) timeout $(tmo 150) $PY -m kvbridge.bench.transfer_cuda --no-memcpy --agents cuda_ipc \
      --sizes $SIZES --reps 3 --json $D/transfer_${side}_$round.json 2>&1 | tail -6
  done
done

if left "new without side upload"; then  # 4. the side-stream upload's share (new tree only)
  echo "== new direct_gpu --option side_upload=false"
  PYTHONPATH=$(pp new) timeout $(tmo 150) $PY "$NEWSRC/bench/direct_gpu.py" --requests ${REQUESTS:-3} \
    --option side_upload=false --json $D/direct_gpu_new_same_stream.jsonl 2>&1 | grep -v '^{'
fi
if left "new transfer without side upload"; then
  echo "== new transfer_cuda --no-side-upload"
  PYTHONPATH=$(pp new) timeout $(tmo 150) $PY -m kvbridge.bench.transfer_cuda --no-memcpy --agents cuda_ipc \
    --sizes $SIZES --reps 3 --no-side-upload --json $D/transfer_new_same_stream.json 2>&1 | tail -6
fi

for pc in ${POST_CHUNKS:-65536}; do  # coarser pipelining now that a chunk's host work is cheaper (new tree)
  left "new transfer post_chunk $pc" || break
  echo "== new transfer_cuda --post-chunk $pc"
  PYTHONPATH=$(pp new) timeout $(tmo 150) $PY -m kvbridge.bench.transfer_cuda --no-memcpy --agents cuda_ipc \
    --sizes $SIZES --reps 3 --post-chunk $pc --json $D/transfer_new_pc$pc.json 2>&1 | tail -6
done

if [ -n "${TESTS:-}" ] && left "tests"; then  # 5. GPU tests of the changed code
  echo "== GPU tests (new)"
  mkdir -p $T/pkg/kvbridge && cp -r $(ls -A "$NEWSRC" | grep -v -x -e .whl -e .git -e .venv | sed "s|^|$NEWSRC/|") $T/pkg/kvbridge/
  (cd $T/pkg/kvbridge && PYTHONPATH=${SITE}$T/pkg timeout $(tmo 300) \
    $PY -m pytest -q -p no:cacheprovider -p no:randomly tests/gpu/test_cuda_ipc.py tests/gpu/test_transceiver_gpu.py \
    2>&1 | grep -vE '^\{' | tail -15) | tee $D/tests.txt
fi
echo "done in ${SECONDS}s"
rm -rf $T
