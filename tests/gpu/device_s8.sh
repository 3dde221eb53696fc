#!/usr/bin/env bash
# Issue 24, session 5's merged tree on a 2-GPU host, from the repo root with $OUT set (carry .whl, .whl-serving):
#   1. the GPU tests of what this session touched: tests/gpu/test_transceiver_gpu.py (host staging, grid kernel,
#      the 1 GiB requests) and test_cuda_ipc.py
#   2. kvbridge bench serve phase C (8k, NIXL with UCX forced to TCP: direct and staged through host memory)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export KVBRIDGE_CACHE_DIR=/tmp/kvbc NIXL_LOG_LEVEL=WARN UCX_LOG_LEVEL=error
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl .whl-serving/*.whl || exit 3
rm -rf /tmp/pkg && mkdir -p /tmp/pkg/kvbridge && cp -r $(ls -A | grep -v -x -e .whl -e .whl-serving -e .git -e .venv \
  -e .venv-vllm) /tmp/pkg/kvbridge/
cd /tmp/pkg/kvbridge && export PYTHONPATH=/tmp/site:/tmp/pkg
{ nvidia-smi -L; nproc; date -u; } > $OUT/env.txt 2>&1
echo "== $SECONDS s: GPU tests"
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -ra -p no:cacheprovider -p no:randomly \
  tests/gpu/test_transceiver_gpu.py tests/gpu/test_cuda_ipc.py 2>&1 | grep -vE '^\{' | tee $OUT/tests.log | tail -15
echo "== $SECONDS s: bench serve phase C"
timeout ${BENCH_TIMEOUT:-300} python3 -m kvbridge.bench serve --phases C --prompts 8192 --repeat 3 \
  --json $OUT/serve_tcp.json 2>&1 | grep -vE '^\{|Warning|legend' | tee $OUT/serve.log | tail -12
echo "done in ${SECONDS}s"
