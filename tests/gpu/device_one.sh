#!/usr/bin/env bash
# One-GPU checks in one lease (nvidia-h100-x1 / nvidia-h200), from the repo root with $OUT set; carry .whl and
# .whl-serving (../shared/tools/gpu-wheels.sh). The control-plane bench, check-agent on VRAM, the 1-GPU tests.
set -u
export NCCL_NVLS_ENABLE=0 UCX_LOG_LEVEL=error NIXL_LOG_LEVEL=WARN PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl-serving/*.whl || exit 3
mkdir -p /tmp/pp && ln -sfn $PWD /tmp/pp/kvbridge && export PYTHONPATH=/tmp/site:/tmp/pp
nvidia-smi -L | tee $OUT/env.txt
echo "== control"; timeout 200 python3 -m kvbridge.bench control --gens 1,8,64 --requests 3000 --window 64 --json $OUT/control.json 2>&1 | tail -5
echo "== check-agent cuda_ipc vram"; timeout 120 python3 -m kvbridge.cli check-agent cuda_ipc --memory vram 2>&1 | tail -16
echo "== check-agent nixl vram"; timeout 120 python3 -m kvbridge.cli check-agent nixl --memory vram 2>&1 | tail -16
echo "== pytest 1-GPU"; timeout 300 python3 -m pytest -q -p no:cacheprovider -p no:randomly --timeout 240 -m "not multigpu" tests/gpu/test_cuda_ipc.py tests/executor/test_cuda.py tests/gpu/test_nvrtc_absent.py "tests/executor/test_streaming.py::test_cuda_streamed_prefill_marks_layers_by_events_and_decodes_the_aggregated_tokens" 2>&1 | tail -15
