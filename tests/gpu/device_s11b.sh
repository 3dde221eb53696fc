#!/usr/bin/env bash
# Session 8 (issue 24), second call: where the link goes when two copy kernels share it (bench/launch_mix.py, one
# process), then TP1 -> TP2 through the transceiver with generation rank 1 on the context's GPU, at full occupancy
# and capped, alternated with the default; on a 2-GPU host, from the repo root with $OUT set:
#   run(command="bash tests/gpu/device_s11b.sh", carry=[".whl", ".whl-serving"], kind="nvidia-h100-x2")
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 KVBRIDGE_CACHE_DIR=/tmp/kvbc NIXL_LOG_LEVEL=WARN UCX_LOG_LEVEL=error
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl .whl-serving/*.whl || exit 3
rm -rf /tmp/pkg && mkdir -p /tmp/pkg/kvbridge && cp -r $(ls -A | grep -v -x -e .whl -e .whl-serving -e .git -e .venv \
  -e .venv-vllm) /tmp/pkg/kvbridge/
cd /tmp/pkg/kvbridge && export PYTHONPATH=/tmp/site:/tmp/pkg
{ nvidia-smi -L; nproc; date -u; } > $OUT/env.txt 2>&1
for frag in ${FRAGS:-16384 65536}; do
  echo "== $SECONDS s: launch_mix, $frag-byte fragments"
  timeout 120 python3 -m kvbridge.bench.launch_mix --frag $frag --reps 5 --json $OUT/launch_mix.jsonl
done
for round in ${ROUNDS:-1 2}; do
  for variant in ${VARIANTS:-default peer peer66}; do
    case $variant in
      default) opt=() ;; peer) opt=(--gen-option 1:launch_on=peer) ;;
      peer66) opt=(--gen-option 1:launch_on=peer --gen-option 1:max_blocks=66) ;;
    esac
    echo "== $SECONDS s: round $round, $variant"
    timeout 150 python3 -m kvbridge.bench.direct_gpu --agent cuda_ipc --splits 1:2 --requests ${REQUESTS:-9} \
      "${opt[@]}" --json $OUT/direct_$variant.jsonl 2>&1 | grep -vE '^\{' | tail -2
  done
done
echo "done in ${SECONDS}s"
