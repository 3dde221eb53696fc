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

# TP1 -> TP2's 1 GiB direct path, ROUNDS rounds (default $1) of VARIANTS (default "default peer") alternated, REQUESTS
# requests each (default $2): python -m kvbridge.bench.direct_gpu --splits 1:2, rows in $OUT/direct_<variant>.jsonl.
# Variants: default; peer = generation rank 1's kernel on the context's GPU (launch_on=peer, its rank_options);
# peer66 = peer with max_blocks=66.
direct_rounds() {
  local round variant opt
  for round in ${ROUNDS:-$1}; do
    for variant in ${VARIANTS:-default peer}; do
      case $variant in
        default) opt=() ;; peer) opt=(--gen-option 1:launch_on=peer) ;;
        peer66) opt=(--gen-option 1:launch_on=peer --gen-option 1:max_blocks=66) ;;
      esac
      echo "== $SECONDS s: round $round, $variant"
      timeout 150 python3 -m kvbridge.bench.direct_gpu --agent cuda_ipc --splits 1:2 --requests ${REQUESTS:-$2} \
        "${opt[@]}" --json $OUT/direct_$variant.jsonl 2>&1 | grep -vE '^\{' | tail -2
    done
  done
}
