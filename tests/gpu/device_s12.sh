#!/usr/bin/env bash
# Session 9 (issue 24): transceiver.rank_options on 2 GPUs -- generation rank 1's cuda_ipc kernel on the context's
# GPU (launch_on: peer) set through the public config, in the transceiver test and the 1 GiB direct path.
# From the repo root with $OUT set:
#   run(command="STEPS='tests direct' bash tests/gpu/device_s12.sh", carry=[".whl", ".whl-serving"],
#       kind="nvidia-h100-x2")
#   run(command="STEPS=serve bash tests/gpu/device_s12.sh", carry=[".whl", ".whl-serving"], kind="nvidia-h100-x2")
# STEPS, in this order:
#   tests   tests/gpu/test_transceiver_gpu.py -k cuda_ipc: TP2 -> TP1 and TP1 -> TP2, with and without rank 1 on
#           peer, 1 GiB each, verified (tests.log)
#   direct  ROUNDS rounds (default "1 2") of VARIANTS (default "default peer"; also peer66 = peer + max_blocks=66)
#           alternated: python -m kvbridge.bench.direct_gpu --splits 1:2 --requests REQUESTS (default 12; rows:
#           direct_<variant>.jsonl)
#   serve   kvbridge bench serve --phases B --hetero-tokens 8192 --repeat 3 (serve_peer.json + .png; the session's run
#           had --hetero-peer, since removed: bench/RESULTS.md "Session 9")
set -uo pipefail
source tests/gpu/device_prelude.sh
steps=" ${STEPS:-tests direct} "
if [[ $steps == *" tests "* ]]; then
  echo "== $SECONDS s: GPU transceiver tests (cuda_ipc)"
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -ra -s -p no:cacheprovider -p no:randomly --timeout 240 \
    tests/gpu/test_transceiver_gpu.py -k cuda_ipc > $OUT/tests.log 2>&1
  grep -E '^\{' $OUT/tests.log | tail -8; tail -4 $OUT/tests.log
fi
if [[ $steps == *" direct "* ]]; then
  direct_rounds "1 2" 12
fi
if [[ $steps == *" serve "* ]]; then
  echo "== $SECONDS s: bench serve phase B"
  timeout ${BENCH_TIMEOUT:-560} python3 -m kvbridge.bench serve --phases B --hetero-tokens 8192 \
    --repeat 3 --json $OUT/serve_peer.json > $OUT/serve.log 2>&1
  grep -vE '^\{' $OUT/serve.log | tail -25
fi
echo "done in ${SECONDS}s"
