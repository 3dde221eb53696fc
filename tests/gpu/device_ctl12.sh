#!/usr/bin/env bash
# Session 12 (issue 24): the generation rank's submit running its turn on the caller's thread, before/after on
# one device host. Alternates the code at .base/kvbridge (`git archive 60d67e6`, carried as an ignored path) and
# this checkout: the per-hop trace (one request at a time) and `kvbridge bench control --gens 1` (latency and
# throughput), three rounds, so the ratios come from one lease. From the repo root with $OUT set; carry .whl,
# .whl-serving and .base:
#   mkdir -p .base/kvbridge && git archive 60d67e6 | tar -x -C .base/kvbridge
# Everything lands in $OUT/ctl12.tar.gz (one file: the device tool brings back only a few).
set -u
export NCCL_NVLS_ENABLE=0 UCX_LOG_LEVEL=error NIXL_LOG_LEVEL=WARN PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl-serving/*.whl || exit 3
mkdir -p /tmp/pp && ln -sfn $PWD /tmp/pp/kvbridge
NEW=/tmp/site:/tmp/pp BASE=/tmp/site:$PWD/.base
R=/tmp/ctl12 && mkdir -p $R
nproc | tee $R/env.txt; nvidia-smi -L | tee -a $R/env.txt
for round in 1 2 3; do
  for side in base new; do
    if [ $side = base ]; then PP=$BASE; else PP=$NEW; fi
    echo "== round $round $side trace"
    PYTHONPATH=$PP timeout 120 python3 -m kvbridge.bench.control_trace --requests 500 > $R/trace_${side}_$round.txt 2>&1
    head -1 $R/trace_${side}_$round.txt
    echo "== round $round $side control"
    PYTHONPATH=$PP timeout 150 python3 -m kvbridge.cli bench control --gens 1 --requests 3000 --window 64 \
      --json $R/control_${side}_$round.json 2>&1 | tail -2
  done
done
tar -czf $OUT/ctl12.tar.gz -C $R .
