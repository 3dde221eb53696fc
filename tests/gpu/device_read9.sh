#!/usr/bin/env bash
# Issue 24 (read9): a list's ranges checked in the passes each part makes (checks_ranges) against main, in one
# lease on a 2-GPU host. Run from the lead's checkout (= main, the base) holding this tree under
# $ROOT/new/kvbridge (default .dev-read9), with $OUT set; carry .whl and $ROOT. A step starts only with 30 s of
# the $HARD-second budget left, in this order (what matters most first):
#   1. bench/read_ab.py on new: --modes checked,fused alternated READ by READ in one process (every READ verified)
#   2. transfer_cuda --no-memcpy --agents cuda_ipc --sizes $SIZES --reps 3: new, base
#   3. tests/gpu/test_cuda_ipc.py and test_transceiver_gpu.py on new
#   4. bench/direct_gpu.py --requests 4: new, base, new with grid_kernel=false (1 GiB through the transceiver,
#      TP2 -> TP1 and TP1 -> TP2)
#   5. transfer_cuda again: new, base
set -u
export NCCL_NVLS_ENABLE=0 UCX_LOG_LEVEL=error NIXL_LOG_LEVEL=WARN PYTHONUNBUFFERED=1 KVBRIDGE_CACHE_DIR=/tmp/kvbc
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
ROOT=$(realpath "${ROOT:-.dev-read9}") D=$OUT HARD=${HARD:-280} SIZES=${SIZES:-4096,16384,65536}
mkdir -p /tmp/base $D/tc && ln -sfn "$PWD" /tmp/base/kvbridge
path() { if [ "$1" = base ]; then echo /tmp/site:/tmp/base; else echo /tmp/site:$ROOT/new; fi; }
left() { if [ $((HARD - SECONDS)) -ge 30 ]; then return 0; fi; echo "== skipped (${SECONDS}s of ${HARD}s): $*"; return 1; }
tmo() { local t=$((HARD - SECONDS)); [ $t -gt $1 ] && t=$1; echo $t; }
(nproc; nvidia-smi -L 2>&1; date -u) | tee $D/env.txt
if left read_ab; then
  echo "== new read_ab checked vs fused"
  (cd /tmp && PYTHONPATH=$(path new) timeout $(tmo 70) python3 -m kvbridge.bench.read_ab --modes checked,fused \
    --sizes 4096,16384,65536,1073741824 --reps 12 --json $D/read_ab.json 2>&1 | tail -5)
fi
tc() {  # tree round
  left "transfer $1 round $2" || return
  echo "== $SECONDS s: round $2 $1 transfer_cuda"
  (cd /tmp && PYTHONPATH=$(path $1) timeout $(tmo 40) python3 -m kvbridge.bench.transfer_cuda --no-memcpy \
    --agents cuda_ipc --sizes $SIZES --reps 3 --json $D/tc/${1}_$2.json 2>&1 | tail -4)
}
tc new 1; tc base 1
if left tests; then
  echo "== $SECONDS s: GPU tests (new)"
  (cd $ROOT/new/kvbridge && PYTHONPATH=$(path new) timeout $(tmo 150) python3 -m pytest -q -p no:cacheprovider \
    -p no:randomly tests/gpu/test_cuda_ipc.py tests/gpu/test_transceiver_gpu.py 2>&1 | grep -vE '^\{' | tail -15) | tee $D/tests.txt
fi
for t in new base nogrid; do  # nogrid: new with the grid kernel off (the receiver's change alone)
  left "direct $t" || break
  echo "== $SECONDS s: $t direct_gpu"
  opt=(); tree=$t; if [ $t = nogrid ]; then opt=(--option grid_kernel=false); tree=new; fi
  (cd /tmp && PYTHONPATH=$(path $tree) timeout $(tmo 60) python3 "$ROOT/new/kvbridge/bench/direct_gpu.py" --requests 4 \
    "${opt[@]}" --json $D/direct_gpu_$t.jsonl 2>&1 | grep -v '^{' | tail -4)
done
tc new 2; tc base 2
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
