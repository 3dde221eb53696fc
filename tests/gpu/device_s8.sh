#!/usr/bin/env bash
# Issue 24, session 5's merged tree on a 2-GPU host, from the repo root with $OUT set (carry .whl, .whl-serving):
#   1. the GPU tests of what this session touched: tests/gpu/test_transceiver_gpu.py (host staging, grid kernel,
#      the 1 GiB requests) and test_cuda_ipc.py
#   2. kvbridge bench serve phase C (8k, NIXL with UCX forced to TCP: direct and staged through host memory)
set -uo pipefail
source tests/gpu/device_prelude.sh
echo "== $SECONDS s: GPU tests"
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -ra -p no:cacheprovider -p no:randomly \
  tests/gpu/test_transceiver_gpu.py tests/gpu/test_cuda_ipc.py 2>&1 | grep -vE '^\{' | tee $OUT/tests.log | tail -15
echo "== $SECONDS s: bench serve phase C"
timeout ${BENCH_TIMEOUT:-300} python3 -m kvbridge.bench serve --phases C --prompts 8192 --repeat 3 \
  --json $OUT/serve_tcp.json 2>&1 | grep -vE '^\{|Warning|legend' | tee $OUT/serve.log | tail -12
echo "done in ${SECONDS}s"
