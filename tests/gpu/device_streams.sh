#!/usr/bin/env bash
# The cuda_ipc agent's `streams` (each peer's kernels on a stream of its own): its GPU tests, then ctx TP2 -> gen
# TP1's 1 GiB direct path (bench/direct_gpu.py), variants alternated for ROUNDS rounds (default "1 2") with the
# ranks placed as on two GPUs (shared) and a GPU per rank (--spread: 3 GPUs). Variants: default; s2 = streams=2;
# s2mb66 = streams=2 max_blocks=66 (half an H100's SMs per kernel). From the repo root with $OUT set; carry .whl
# and .whl-serving. Rows: $OUT/streams_<variant>_<placement>.jsonl.
set -u
source tests/gpu/device_prelude.sh
timeout 240 python3 -m pytest -q -p no:cacheprovider --timeout 200 tests/gpu/test_cuda_ipc_process.py \
  tests/gpu/test_cuda_ipc.py 2>&1 | tail -3
for round in ${ROUNDS:-1 2}; do
  for place in shared spread; do
    for variant in ${VARIANTS:-default s2mb66 s2}; do
      case $variant in
        default) opt=() ;; s2) opt=(--option streams=2) ;; s2mb66) opt=(--option streams=2 --option max_blocks=66) ;;
      esac
      [ $place = spread ] && opt+=(--spread)
      echo "== $SECONDS s: round $round, $place, $variant"
      timeout 120 python3 -m kvbridge.bench.direct_gpu --agent cuda_ipc --splits 2:1 --requests 9 "${opt[@]}" \
        --json $OUT/streams_${variant}_$place.jsonl 2>&1 | grep -vE '^\{' | tail -2
    done
  done
done
echo "done at $SECONDS s"
