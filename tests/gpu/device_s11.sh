#!/usr/bin/env bash
# Session 8 (issue 24): TP1 -> TP2's 1 GiB direct path with generation rank 1's copy kernel on the context's GPU
# (cuda_ipc launch_on=peer) against the default, on a 2-GPU host, from the repo root with $OUT set:
#   run(command="bash tests/gpu/device_s11.sh", carry=[".whl", ".whl-serving"], kind="nvidia-h100-x2")
# STEPS (default "direct 2to1 tests"), in this order:
#   mix     python -m kvbridge.bench.launch_mix --frag F for F in FRAGS (default "16384 65536"): two halves' kernels
#           in one process, where each runs (rows: launch_mix.jsonl)
#   direct  ROUNDS rounds (default "1 2 3") of VARIANTS (default "default peer"; also peer66 = peer + max_blocks=66),
#           alternated: python -m kvbridge.bench.direct_gpu --splits 1:2 --requests 9 (rows: direct_<variant>.jsonl)
#   2to1    TP2 -> TP1 with the one generation rank on launch_on=peer, 5 requests (direct_peer_2to1.jsonl)
#   tests   the cuda_ipc and transceiver GPU tests (tests.log)
set -uo pipefail
source tests/gpu/device_prelude.sh
steps=" ${STEPS:-direct 2to1 tests} "
if [[ $steps == *" mix "* ]]; then
  for frag in ${FRAGS:-16384 65536}; do
    echo "== $SECONDS s: launch_mix, $frag-byte fragments"
    timeout 120 python3 -m kvbridge.bench.launch_mix --frag $frag --reps 5 --json $OUT/launch_mix.jsonl
  done
fi
if [[ $steps == *" direct "* ]]; then
  direct_rounds "1 2 3" 9
fi
if [[ $steps == *" 2to1 "* ]]; then
  echo "== $SECONDS s: TP2 -> TP1 with launch_on=peer on the one generation rank (for the record)"
  timeout 150 python3 -m kvbridge.bench.direct_gpu --agent cuda_ipc --splits 2:1 --requests 5 --option launch_on=peer \
    --json $OUT/direct_peer_2to1.jsonl 2>&1 | grep -vE '^\{' | tail -3
fi
if [[ $steps == *" tests "* ]]; then
  echo "== $SECONDS s: GPU tests"
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -ra -p no:cacheprovider -p no:randomly --timeout 240 \
    tests/gpu/test_cuda_ipc_process.py tests/gpu/test_cuda_ipc.py tests/gpu/test_transceiver_gpu.py \
    2>&1 | grep -vE '^\{' > $OUT/tests.log
  tail -15 $OUT/tests.log
fi
echo "done in ${SECONDS}s"
