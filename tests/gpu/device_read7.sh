#!/usr/bin/env bash
# Issue 24, one cuda_ipc READ end to end (bench/RESULTS.md, "One READ's time, piece by piece"): base, new and
# new + `__launch_bounds__(256, 3)` on kvb_copy_any ("lb3") in one lease on a 2-GPU host. From a folder holding
# base/kvbridge, new/kvbridge and lb3/kvbridge (ROOT, default .dev-read7), with $OUT set; carry .whl and ROOT.
# Steps (rows merged into $OUT/transfer.json; a step starts only with 30 s of the $HARD-second budget left):
#   1. transfer_cuda --no-memcpy --agents cuda_ipc --sizes $SIZES --reps 3: base, new, lb3
#   2. bench/read_timeline.py on new (where each piece of one READ goes)
#   3. tests/gpu/test_cuda_ipc.py and test_transceiver_gpu.py on the lb3 tree (new's host code + lb3's kernel)
#   4. transfer_cuda again: lb3, new, base (the other order)
#   5. bench/direct_gpu.py --requests 3: base, new (1 GiB through the transceiver, TP2 -> TP1 and TP1 -> TP2)
set -u
export NCCL_NVLS_ENABLE=0 UCX_LOG_LEVEL=error NIXL_LOG_LEVEL=WARN PYTHONUNBUFFERED=1 KVBRIDGE_CACHE_DIR=/tmp/kvbc
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
ROOT=$(realpath "${ROOT:-.dev-read7}") D=$OUT HARD=${HARD:-400} SIZES=${SIZES:-4096,16384,65536}
mkdir -p $D/tc
left() { if [ $((HARD - SECONDS)) -ge 30 ]; then return 0; fi; echo "== skipped (${SECONDS}s of ${HARD}s): $*"; return 1; }
tmo() { local t=$((HARD - SECONDS)); [ $t -gt $1 ] && t=$1; echo $t; }
(nproc; nvidia-smi -L 2>&1; date -u) | tee $D/env.txt
tc() {  # tree round
  left "transfer $1 round $2" || return
  echo "== round $2 $1 transfer_cuda"
  (cd /tmp && PYTHONPATH=/tmp/site:$ROOT/$1 timeout $(tmo 120) python3 -m kvbridge.bench.transfer_cuda --no-memcpy \
    --agents cuda_ipc --sizes $SIZES --reps 3 --json $D/tc/${1}_$2.json 2>&1 | tail -5)
}
for t in base new lb3; do tc $t 1; done
if left timeline; then
  echo "== new read_timeline"
  (cd /tmp && PYTHONPATH=/tmp/site:$ROOT/new timeout $(tmo 90) python3 -m kvbridge.bench.read_timeline \
    --sizes 1073741824,65536,16384 --reps 8 --label new --json $D/timeline_new.json 2>&1 | grep -v calls/READ)
fi
if left tests; then
  echo "== GPU tests (lb3 tree)"
  (cd $ROOT/lb3/kvbridge && PYTHONPATH=/tmp/site:$ROOT/lb3 timeout $(tmo 200) python3 -m pytest -q -p no:cacheprovider \
    -p no:randomly tests/gpu/test_cuda_ipc.py tests/gpu/test_transceiver_gpu.py 2>&1 | grep -vE '^\{' | tail -15) | tee $D/tests.txt
fi
for t in lb3 new base; do tc $t 2; done
for t in base new; do
  left "direct $t" || break
  echo "== $t direct_gpu"
  (cd /tmp && PYTHONPATH=/tmp/site:$ROOT/$t timeout $(tmo 150) python3 "$ROOT/new/kvbridge/bench/direct_gpu.py" --requests 3 \
    --json $D/direct_gpu_$t.jsonl 2>&1 | grep -v '^{' | tail -6)
done
python3 - "$D" <<'PY'
import glob, json, os, sys
d = sys.argv[1]
rows = []
for f in sorted(glob.glob(os.path.join(d, "tc", "*.json"))):
    tree, rnd = os.path.basename(f)[:-5].rsplit("_", 1)
    for r in json.load(open(f))["rows"]:
        rows.append(dict(r, tree=tree, round=int(rnd)))
        print(f"{tree:5} r{rnd} {r['fragment_bytes'] >> 10:>8} KiB {r['gbps']:6.1f} GB/s gpu {r.get('gpu_gbps')} "
              f"post_ms {r.get('post_ms')} pipelined {r.get('pipelined_gbps')} verified {r['verified']}")
json.dump({"benchmark": "transfer_cuda", "rows": rows}, open(os.path.join(d, "transfer.json"), "w"), indent=1)
PY
rm -rf $D/tc
echo "done in ${SECONDS}s"
