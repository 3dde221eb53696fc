#!/usr/bin/env bash
# Session 8 (issue 24): the control plane on the GPU host's CPU with this tree, three runs of one generation rank
# and one of 8, from the repo root with $OUT set:
#   run(command="bash tests/gpu/device_control_s11.sh", carry=[".whl", ".whl-serving"], kind="nvidia-h100-x2")
set -uo pipefail
source tests/gpu/device_prelude.sh
for i in 1 2 3; do
  echo "== $SECONDS s: run $i, one generation rank"
  timeout 120 python3 -m kvbridge.bench control --gens 1 --requests 3000 --window 64 --json $OUT/control_g1_$i.json \
    2>&1 | tail -1
done
echo "== $SECONDS s: 8 generation ranks"
timeout 150 python3 -m kvbridge.bench control --gens 8 --requests 3000 --window 64 --json $OUT/control_g8.json 2>&1 | tail -1
echo "done in ${SECONDS}s"
