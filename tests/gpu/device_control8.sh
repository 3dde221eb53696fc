#!/usr/bin/env bash
# The control plane's cost per request (issue 24, ctl8) on the GPU host's CPUs: base against new, alternated in
# one lease, then the run of record. Runs from the lead's checkout (= base) with $OUT set; new = a copy of the
# branch's tree in .dev-ctl8 (the package folder itself, or a folder holding kvbridge/). Carry .whl and .dev-ctl8:
#   run(command="bash .dev-ctl8/tests/gpu/device_control8.sh", carry=[".whl", ".dev-ctl8"], kind="nvidia-h100-x2")
# Both trees run the new tree's bench/control.py (it only adds the CPU-per-request columns), so their rows
# compare column for column. Knobs: ROUNDS (default "1 2 3"), GENS (default 1,8), RECORD_GENS (1,8,64; empty:
# no run of record), TRACE (default 1; empty: no per-hop trace of both trees), WORK (scratch folder).
set -u
export UCX_LOG_LEVEL=error NIXL_LOG_LEVEL=WARN PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
W=${WORK:-/tmp/kvb-ctl8} && rm -rf $W && mkdir -p $W/base/kvbridge $W/new
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $W/site .whl/*.whl || exit 3
NEWSRC=$(realpath "${NEW:-.dev-ctl8}")
[ -d "$NEWSRC/kvbridge" ] && NEWSRC="$NEWSRC/kvbridge"
ln -sfn "$NEWSRC" $W/new/kvbridge
cp -r $(ls -A | grep -v -x -e .whl -e .whl-serving -e .git -e .venv -e .venv-vllm -e .dev-ctl8) $W/base/kvbridge/
cp "$NEWSRC/bench/control.py" $W/base/kvbridge/bench/control.py
pp() { echo "$W/site:$W/$1"; }
(nproc; uptime; nvidia-smi -L; git log --oneline -1 2>/dev/null) | tee $OUT/env.txt
for round in ${ROUNDS:-1 2 3}; do
  for side in base new; do
    echo "== round $round $side: control --gens ${GENS:-1,8}"
    PYTHONPATH=$(pp $side) timeout 150 python3 -m kvbridge.bench control --gens ${GENS:-1,8} --requests 2000 \
      --window 64 --json $OUT/control_${side}_$round.json 2>&1 | tail -4
  done
done
if [ -n "${TRACE-1}" ]; then
  for side in base new; do
    echo "== $side control trace"
    PYTHONPATH=$(pp $side) timeout 90 python3 -m kvbridge.bench.control_trace --requests 300 2>&1 | tail -16 \
      | tee $OUT/trace_$side.txt
  done
fi
if [ -n "${RECORD_GENS-1,8,64}" ]; then
  echo "== new: control of record, gens ${RECORD_GENS-1,8,64}"
  PYTHONPATH=$(pp new) timeout 200 python3 -m kvbridge.bench control --gens ${RECORD_GENS-1,8,64} --requests 3000 \
    --window 64 --json $OUT/control.json 2>&1 | tail -6
fi
echo done
