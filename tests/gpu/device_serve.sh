#!/usr/bin/env bash
# `kvbridge bench serve` on a 2-GPU device machine (bench/RESULTS.md). Run from the repo root with $OUT set;
# needs .whl (../shared/tools/gpu-wheels.sh) and .whl-serving (fastapi, starlette, uvicorn, pydantic, ...).
# Usage: bash tests/gpu/device_serve.sh [bench serve args...]; SRC: the tree to run (default: this one).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export KVBRIDGE_CACHE_DIR=/tmp/kvbc NIXL_LOG_LEVEL=WARN UCX_LOG_LEVEL=error
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl .whl-serving/*.whl || exit 3
rm -rf /tmp/pkg && mkdir -p /tmp/pkg/kvbridge && cp -r "${SRC:-.}"/. /tmp/pkg/kvbridge/
cd /tmp/pkg/kvbridge && export PYTHONPATH=/tmp/site:/tmp/pkg
{ nvidia-smi -L; nvidia-smi topo -m; } > $OUT/env.txt 2>&1
timeout ${BENCH_TIMEOUT:-540} python3 -m kvbridge.bench serve --json $OUT/serve_gpu.json "$@" 2>&1 | tee $OUT/serve.log
nvidia-smi --query-gpu=index,memory.used --format=csv >> $OUT/env.txt 2>&1
echo done
