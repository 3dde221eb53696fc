#!/usr/bin/env bash
# Session 8 (issue 24): TP1 -> TP2's 1 GiB direct path with generation rank 1's copy kernel on the context's GPU
# (cuda_ipc launch_on=peer) against the default, alternated, then the cuda_ipc and transceiver GPU tests; on a
# 2-GPU host, from the repo root with $OUT set, one call:
#   run(command="bash tests/gpu/device_s11.sh", carry=[".whl", ".whl-serving"], kind="nvidia-h100-x2")
# Rows: $OUT/direct_default.jsonl, $OUT/direct_peer.jsonl (ROUNDS rounds of `--requests 9` each), tests.log.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export KVBRIDGE_CACHE_DIR=/tmp/kvbc NIXL_LOG_LEVEL=WARN UCX_LOG_LEVEL=error
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl .whl-serving/*.whl || exit 3
rm -rf /tmp/pkg && mkdir -p /tmp/pkg/kvbridge && cp -r $(ls -A | grep -v -x -e .whl -e .whl-serving -e .git -e .venv \
  -e .venv-vllm) /tmp/pkg/kvbridge/
cd /tmp/pkg/kvbridge && export PYTHONPATH=/tmp/site:/tmp/pkg KVBRIDGE_GPU_RESULTS=$OUT/gpu_rows.jsonl
{ nvidia-smi -L; nproc; date -u; } > $OUT/env.txt 2>&1
for round in ${ROUNDS:-1 2 3}; do
  for variant in default peer; do
    opt=(); [ $variant = peer ] && opt=(--gen-option 1:launch_on=peer)
    echo "== $SECONDS s: round $round, $variant"
    timeout 150 python3 -m kvbridge.bench.direct_gpu --agent cuda_ipc --splits 1:2 --requests ${REQUESTS:-9} \
      "${opt[@]}" --json $OUT/direct_$variant.jsonl 2>&1 | grep -vE '^\{' | tail -3
  done
done
echo "== $SECONDS s: TP2 -> TP1 with launch_on=peer on the one generation rank (for the record)"
timeout 150 python3 -m kvbridge.bench.direct_gpu --agent cuda_ipc --splits 2:1 --requests 5 --option launch_on=peer \
  --json $OUT/direct_peer_2to1.jsonl 2>&1 | grep -vE '^\{' | tail -3
echo "== $SECONDS s: GPU tests"
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -ra -p no:cacheprovider -p no:randomly --timeout 240 \
  tests/gpu/test_cuda_ipc_process.py tests/gpu/test_cuda_ipc.py tests/gpu/test_transceiver_gpu.py \
  2>&1 | grep -vE '^\{' > $OUT/tests.log
tail -15 $OUT/tests.log
echo "done in ${SECONDS}s"
