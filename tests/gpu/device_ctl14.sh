#!/usr/bin/env bash
# Session 14 (issue 24): the generation rank's per-request Python trimmed (layout hash and fingerprint once, block
# ids checked once, DisaggParams with slots; bench control's generation rank waits on its pipe with one poll
# object). Alternates the code at .base/kvbridge (`git archive 880420e`, carried as an ignored path) and this
# checkout, three rounds in one lease: `kvbridge bench control --gens 1` (latency and throughput), then the
# throughput phase alone (20,000 requests at 64 in flight after a 300-request warm-up, bench/control.py's
# `_ContextRank`, driven by tests/gpu/control_throughput.py). From the repo root with $OUT set; carry .whl,
# .whl-serving and .base:
#   mkdir -p .base/kvbridge && git archive 880420e | tar -x -C .base/kvbridge
# Everything lands in $OUT/ctl14.tar.gz.
set -u
export NCCL_NVLS_ENABLE=0 UCX_LOG_LEVEL=error NIXL_LOG_LEVEL=WARN PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl-serving/*.whl || exit 3
mkdir -p /tmp/pp && ln -sfn $PWD /tmp/pp/kvbridge
NEW=/tmp/site:/tmp/pp BASE=/tmp/site:$PWD/.base
R=/tmp/ctl14 && mkdir -p $R
{ nproc; nvidia-smi -L; date -u; } | tee $R/env.txt
for round in 1 2 3; do
  for side in base new; do
    if [ $side = base ]; then PP=$BASE; else PP=$NEW; fi
    echo "== round $round $side control"
    PYTHONPATH=$PP timeout 150 python3 -m kvbridge.cli bench control --gens 1 --requests 3000 --window 64 \
      --json $R/control_${side}_$round.json 2>&1 | tail -1
    echo "== round $round $side throughput"
    PYTHONPATH=$PP timeout 150 python3 $PWD/tests/gpu/control_throughput.py 20000 2>&1 | tail -1 | tee $R/thr_${side}_$round.json
  done
done
tar -czf $OUT/ctl14.tar.gz -C $R .
