#!/usr/bin/env bash
# Paired before/after on one device host: the plan, CPU transfer and control-plane benches of the code at
# .base/kvbridge (a `git archive` of the earlier commit, carried as an ignored path) and of this checkout,
# alternated in one lease so the ratios come from one run. From the repo root with $OUT set; carry .whl,
# .whl-serving and .base:
#   mkdir -p .base/kvbridge && git archive <commit> | tar -x -C .base/kvbridge
set -u
export NCCL_NVLS_ENABLE=0 UCX_LOG_LEVEL=error NIXL_LOG_LEVEL=WARN PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl-serving/*.whl || exit 3
mkdir -p /tmp/pp && ln -sfn $PWD /tmp/pp/kvbridge
NEW=/tmp/site:/tmp/pp BASE=/tmp/site:$PWD/.base
nproc | tee $OUT/env.txt; nvidia-smi -L | tee -a $OUT/env.txt
for round in 1 2; do
  for side in base new; do
    if [ $side = base ]; then PP=$BASE; else PP=$NEW; fi
    echo "== round $round $side plan"
    PYTHONPATH=$PP timeout 120 python3 -m kvbridge.bench plan --repeat 200 --json $OUT/plan_${side}_$round.json 2>&1 | tail -8
    echo "== round $round $side transfer (cpu)"
    PYTHONPATH=$PP timeout 150 python3 -m kvbridge.cli bench transfer --agents nixl,tcp --sizes 16384,524288 --total 268435456 --repeat 2 --json $OUT/transfer_${side}_$round.json 2>&1 | tail -6
    echo "== round $round $side control"
    PYTHONPATH=$PP timeout 150 python3 -m kvbridge.bench control --gens 1,8 --requests 2000 --window 64 --json $OUT/control_${side}_$round.json 2>&1 | tail -4
  done
done
