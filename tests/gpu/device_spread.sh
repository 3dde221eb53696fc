#!/usr/bin/env bash
# The 1 GiB direct path (bench/direct_gpu.py, cuda_ipc, TP1 -> TP2 and TP2 -> TP1) with the ranks placed as on two
# GPUs (context ranks sharing GPU1, generation ranks GPU0) and spread, a GPU per rank (`--spread`: needs 3 GPUs),
# alternated for ROUNDS rounds (default "1 2") of REQUESTS requests each (default 9), on a 4-GPU machine. From the
# repo root with $OUT set; carry .whl and .whl-serving. Rows: $OUT/direct_{shared,spread}.jsonl; topology in
# $OUT/topo.txt.
set -u
source tests/gpu/device_prelude.sh
nvidia-smi topo -m > $OUT/topo.txt 2>&1
for round in ${ROUNDS:-1 2}; do
  for place in shared spread; do
    opt=(); [ $place = spread ] && opt=(--spread)
    echo "== $SECONDS s: round $round, $place"
    timeout 220 python3 -m kvbridge.bench.direct_gpu --agent cuda_ipc --splits 1:2,2:1 --requests ${REQUESTS:-9} \
      "${opt[@]}" --json $OUT/direct_$place.jsonl 2>&1 | grep -vE '^\{' | tail -3
  done
done
echo "done at $SECONDS s"
