#!/usr/bin/env bash
# Everything GPU in one lease, from the repo root on a 2-GPU device machine with $OUT set:
#   PART=tests  bash tests/gpu/device_all.sh   GPU tests: agents (cuda_ipc, nixl VRAM, nccl), executor on CUDA,
#                                              transceiver end to end, multi-GPU disaggregated == aggregated
#   PART=bench  bash tests/gpu/device_all.sh   kvbridge bench transfer --device cuda (JSON to $OUT)
# Needs the wheels from ../shared/tools/gpu-wheels.sh in .whl/ (carry it). The whole GPU suite takes 6-9 minutes,
# near a call's 10: where it runs past TEST_TIMEOUT (540 s), run it in two calls, e.g. TESTS=tests/gpu, then
# TESTS="tests/multigpu tests/agents/test_connection_nccl.py tests/executor/test_cuda.py".
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export KVBRIDGE_CACHE_DIR=/tmp/kvbc NIXL_LOG_LEVEL=WARN UCX_LOG_LEVEL=error TORCH_NCCL_ASYNC_ERROR_HANDLING=2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  $(ls .whl-serving/*.whl 2>/dev/null) || exit 3
rm -rf /tmp/pkg && mkdir -p /tmp/pkg/kvbridge && cp -r $(ls -A | grep -v -x -e .whl -e .whl-serving -e .git -e .venv) /tmp/pkg/kvbridge/
cd /tmp/pkg/kvbridge && export PYTHONPATH=/tmp/site:/tmp/pkg KVBRIDGE_GPU_RESULTS=$OUT/gpu_rows.jsonl
nvidia-smi -L > $OUT/env.txt 2>&1
case "${PART:-tests}" in
  tests)
    timeout ${TEST_TIMEOUT:-540} python3 -m pytest -q -ra -s -p no:cacheprovider --timeout 240 \
      ${TESTS:-tests/gpu tests/multigpu tests/agents/test_connection_nccl.py tests/executor/test_cuda.py} ${GPU_TESTS:-} \
      ${PYTEST_ARGS:-} \
      2>&1 | tee $OUT/tests.log | grep -vE '^\{' | tail -60
    grep -E '^\{' $OUT/tests.log > $OUT/gpu_rows_stdout.jsonl ;;
  bench)
    timeout ${BENCH_TIMEOUT:-400} python3 -m kvbridge.cli bench transfer --device cuda \
      --sizes 4K,16K,64K,128K,512K,4M --agents ${BENCH_AGENTS:-nixl} --json $OUT/gpu_transfer.json 2>&1 \
      | tee $OUT/bench.log ;;
esac
echo done
