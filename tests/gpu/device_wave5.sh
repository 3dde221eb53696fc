#!/usr/bin/env bash
# One lease, 2-GPU device host, from the repo root with $OUT set (carry .whl and .whl-serving):
#   STEP=tests  the GPU suite + the 2-GPU serving test (streaming and overlap on by serving's defaults)
#   STEP=nixl   kvbridge bench serve, NIXL rows only, short, every worker's log kept under $OUT/logs
#   STEP=serve  kvbridge bench serve, the run of record (args in SERVE_ARGS)
#   STEP=control  kvbridge bench control, the run of record (host CPU of the GPU machine)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export KVBRIDGE_CACHE_DIR=/tmp/kvbc NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN} UCX_LOG_LEVEL=${UCX_LOG_LEVEL:-error}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl .whl-serving/*.whl || exit 3
rm -rf /tmp/pkg && mkdir -p /tmp/pkg/kvbridge && cp -r $(ls -A | grep -v -x -e .whl -e .whl-serving -e .git -e .venv -e .venv-vllm) /tmp/pkg/kvbridge/
cd /tmp/pkg/kvbridge && export PYTHONPATH=/tmp/site:/tmp/pkg KVBRIDGE_GPU_RESULTS=$OUT/gpu_rows.jsonl
{ nvidia-smi -L; python3 -c "import httpx, yaml, xxhash, h11, click, anyio; print('deps ok')"; } > $OUT/env.txt 2>&1
for step in ${STEP:-tests}; do
  case "$step" in
    tests)
      timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -ra -p no:cacheprovider --timeout 240 \
        tests/gpu tests/multigpu tests/agents/test_connection_nccl.py tests/executor/test_cuda.py \
        tests/serving/test_cuda.py tests/bench/test_bench_quick.py::test_bench_transfer_cuda_quick ${PYTEST_ARGS:-} 2>&1 | tee $OUT/tests.log | grep -vE '^\{' | tail -40 ;;
    nixl)
      mkdir -p $OUT/logs
      TMPDIR=$OUT/logs timeout ${NIXL_TIMEOUT:-240} python3 -m kvbridge.bench serve --phases A --prompts 1024 \
        --repeat 1 --agents ${NIXL_AGENTS:-nixl/direct,nixl/staged} --requests 2 --load-tokens 256 --max-tokens 4 --json $OUT/serve_nixl.json 2>&1 \
        | tee $OUT/nixl.log | tail -30
      find $OUT/logs -name '*.yaml' -delete ;;
    control)
      timeout ${CONTROL_TIMEOUT:-150} python3 -m kvbridge.bench control --gens 1,8,64 --requests 3000 --window 64 \
        --json $OUT/control.json 2>&1 | tee $OUT/control.log | tail -8 ;;
    serve)
      timeout ${BENCH_TIMEOUT:-540} python3 -m kvbridge.bench serve --json $OUT/serve_gpu.json ${SERVE_ARGS:-} 2>&1 \
        | tee $OUT/serve.log | tail -40 ;;
  esac
done
echo done
