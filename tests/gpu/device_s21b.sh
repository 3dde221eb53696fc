#!/usr/bin/env bash
# Session 21 (issue 24, control plane): the run of record on a GPU host's CPU, three times (requests/s with one
# and eight generation ranks, p50 one at a time), then the bare hops after a 0.5 ms pause. From the repo root
# with $OUT set; carry .whl and .whl-serving.
set -u
. tests/gpu/device_prelude.sh
cat $OUT/env.txt
for round in 1 2 3; do
  echo "== $SECONDS s: control round $round"
  timeout 180 python3 -m kvbridge.bench control --gens 1,8 --requests 3000 --window 64 \
    --json $OUT/control_r$round.json 2>&1 | tail -3
done
