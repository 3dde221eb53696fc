#!/usr/bin/env bash
# Session 7 (issue 24): the 1 GiB direct path once more, then the whole GPU suite on this session's tree, on a
# 2-GPU host, from the repo root with $OUT set; two calls (one is over the 600 s a call may take):
#   run(command="PART=1 bash tests/gpu/device_s10.sh", carry=[".whl", ".whl-serving"], kind="nvidia-h100-x2")
#   run(command="PART=2 bash tests/gpu/device_s10.sh", carry=[".whl", ".whl-serving"], kind="nvidia-h100-x2")
#   PART=1: python -m kvbridge.bench.direct_gpu --agent cuda_ipc --splits 1:2,2:1 --requests 9 (rows: direct.jsonl),
#           then pytest tests/gpu tests/multigpu tests/agents/test_connection_nccl.py (73 tests, ~400 s on 2x H100)
#   PART=2: pytest tests/executor/test_cuda.py tests/serving/test_cuda.py tests/connector (42 tests, ~160 s)
set -uo pipefail
source tests/gpu/device_prelude.sh
export TORCH_NCCL_ASYNC_ERROR_HANDLING=2
export KVBRIDGE_GPU_RESULTS=$OUT/gpu_rows.jsonl
if [ "${PART:-1}" = 1 ]; then
  echo "== $SECONDS s: direct path"
  timeout ${DIRECT_TIMEOUT:-150} python3 -m kvbridge.bench.direct_gpu --agent cuda_ipc --splits 1:2,2:1 \
    --requests ${REQUESTS:-9} --json $OUT/direct.jsonl 2>&1 | grep -vE '^\{' | tail -8
  TESTS="tests/gpu tests/multigpu tests/agents/test_connection_nccl.py"
else
  TESTS="tests/executor/test_cuda.py tests/serving/test_cuda.py tests/connector"
fi
echo "== $SECONDS s: GPU suite, part ${PART:-1}"
timeout ${TEST_TIMEOUT:-540} python3 -m pytest -q -ra -p no:cacheprovider -p no:randomly --timeout 240 $TESTS \
  2>&1 | grep -vE '^\{' > $OUT/tests.log
tail -25 $OUT/tests.log
echo "done in ${SECONDS}s"
