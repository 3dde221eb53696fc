# Sourced by the tests/gpu/device_*.sh scripts, from the repo root on the GPU machine with $OUT set (carry .whl and
# .whl-serving, built by ../shared/tools/gpu-wheels.sh): the environment every run uses, the trimmed wheels into
# /tmp/site, this tree as the package /tmp/pkg/kvbridge (the GPU image has no kvbridge), then cd there with
# PYTHONPATH set, and the machine's GPUs, cores and date in $OUT/env.txt. Exits 3 if the wheels do not install.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export KVBRIDGE_CACHE_DIR=/tmp/kvbc NIXL_LOG_LEVEL=WARN UCX_LOG_LEVEL=error
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl .whl-serving/*.whl || exit 3
rm -rf /tmp/pkg && mkdir -p /tmp/pkg/kvbridge && cp -r $(ls -A | grep -v -x -e .whl -e .whl-serving -e .git -e .venv \
  -e .venv-vllm) /tmp/pkg/kvbridge/
cd /tmp/pkg/kvbridge && export PYTHONPATH=/tmp/site:/tmp/pkg
{ nvidia-smi -L; nproc; date -u; } > $OUT/env.txt 2>&1
