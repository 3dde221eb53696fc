#!/usr/bin/env bash
# One round of GPU work on a 2-GPU device machine (see bench/RESULTS.md): the GPU tests, then the
# transfer benchmark. Run from the repo root with $OUT set; needs the wheels from ../shared/tools/gpu-wheels.sh
# in .whl/. Usage: bash tests/gpu/device_run.sh [pytest-args...]   (BENCH_ARGS adds benchmark options)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export KVBRIDGE_CACHE_DIR=/tmp/kvbc NIXL_LOG_LEVEL=WARN UCX_LOG_LEVEL=error
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 3
# pytest names test modules after the first folder up without __init__.py: give the repo the name kvbridge
rm -rf /tmp/pkg && mkdir -p /tmp/pkg/kvbridge && cp -r $(ls -A | grep -v -x -e .whl -e .git -e .venv) /tmp/pkg/kvbridge/
cd /tmp/pkg/kvbridge && export PYTHONPATH=/tmp/site:/tmp/pkg
{ nvidia-smi -L; nvidia-smi topo -m; python3 -c "import torch, cuda.bindings as cb; print('torch', torch.__version__, 'cuda-bindings', cb.__version__)"; } > $OUT/env.txt 2>&1
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -ra -p no:cacheprovider --timeout 150 tests/gpu "$@" 2>&1 | tee $OUT/tests.log
timeout ${BENCH_TIMEOUT:-300} python3 -m kvbridge.bench.transfer_cuda --json $OUT/gpu_transfer.json ${BENCH_ARGS:-} 2>&1 | tee $OUT/bench.log
for f in /tmp/kvbc/kernels/*.cubin; do
  cuobjdump -sass "$f" | grep -oE '\b(LDG|STG|LD|ST)\.E[.A-Z0-9]*' | sort | uniq -c; done > $OUT/sass.txt 2>&1
echo done
