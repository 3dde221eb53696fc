#!/usr/bin/env bash
# Issue 24, the NIXL-over-TCP row: which UCX settings move GPU memory fastest over loopback TCP, then the serve
# bench's phase C (8k, TP1 -> TP1, NIXL with UCX forced to TCP) with the best of them. Run from the repo root on a
# 2-GPU device machine with $OUT set; carry .whl and .whl-serving. Steps (each bounded; rows into $OUT):
#   1. transfer_cuda --agents nixl, 256 MiB of 64 KiB and 4 MiB fragments, GPU1 -> GPU0, every byte verified,
#      once per UCX variant below (UCX_TLS=tcp,cuda_copy,self on lo in all of them)
#   2. kvbridge bench serve --phases C --prompts 8192 with the variant that read 4 MiB fragments fastest
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 KVBRIDGE_CACHE_DIR=/tmp/kvbc NIXL_LOG_LEVEL=WARN UCX_LOG_LEVEL=error
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl .whl-serving/*.whl || exit 3
rm -rf /tmp/pkg && mkdir -p /tmp/pkg/kvbridge && cp -r . /tmp/pkg/kvbridge/ && rm -rf /tmp/pkg/kvbridge/.whl*
export PYTHONPATH=/tmp/site:/tmp/pkg
D=$OUT && mkdir -p $D/ucx
(nproc; nvidia-smi -L; date -u) > $D/env.txt 2>&1
BASE="UCX_TLS=tcp,cuda_copy,self UCX_NET_DEVICES=lo"
# GPU memory over UCX's TCP transport goes through host bounce buffers in segments of UCX_TCP_*_SEG_SIZE (8 KiB /
# 64 KiB by default), each with its own CUDA copy: larger segments and socket buffers are the first suspects
declare -A V=(
  [default]=""
  [seg64k]="UCX_TCP_TX_SEG_SIZE=64K UCX_TCP_RX_SEG_SIZE=256K UCX_TCP_SNDBUF=8M UCX_TCP_RCVBUF=8M"
  [seg1m]="UCX_TCP_TX_SEG_SIZE=1M UCX_TCP_RX_SEG_SIZE=1M UCX_TCP_SNDBUF=8M UCX_TCP_RCVBUF=8M"
  [seg1m_frag4m]="UCX_TCP_TX_SEG_SIZE=1M UCX_TCP_RX_SEG_SIZE=1M UCX_TCP_SNDBUF=8M UCX_TCP_RCVBUF=8M UCX_RNDV_FRAG_SIZE=host:4M,cuda:4M"
  [frag4m]="UCX_RNDV_FRAG_SIZE=host:4M,cuda:4M"
)
for name in default seg64k seg1m seg1m_frag4m frag4m; do
  echo "== $SECONDS s: $name: ${V[$name]}"
  (cd /tmp && env $BASE ${V[$name]} timeout 90 python3 -m kvbridge.bench.transfer_cuda --no-memcpy --agents nixl \
    --total-mib 256 --sizes 65536,4194304 --reps 2 --json $D/ucx/$name.json 2>&1 | grep -v '^{' | tail -6)
done
BEST=$(python3 - "$D" <<'PY'
import glob, json, os, sys
d, best, rows = sys.argv[1], ("default", 0.0), []
for f in sorted(glob.glob(os.path.join(d, "ucx", "*.json"))):
    name = os.path.basename(f)[:-5]
    for r in json.load(open(f))["rows"]:
        if r["agent"] == "nixl":
            rows.append(dict(r, ucx=name))
            print(f"{name:12} {r['fragment_bytes'] >> 10:>6} KiB {r['gbps']:7.2f} GB/s verified {r['verified']}",
                  file=sys.stderr)
            if r["fragment_bytes"] == 4 << 20 and r["verified"] and r["gbps"] > best[1]:
                best = (name, r["gbps"])
json.dump({"benchmark": "transfer_cuda nixl over UCX TCP", "rows": rows}, open(os.path.join(d, "ucx_tcp.json"), "w"),
          indent=1)
print(best[0])
PY
)
rm -rf $D/ucx
echo "== $SECONDS s: best variant $BEST: ${V[$BEST]}" | tee -a $D/env.txt
if [ "${SERVE:-1}" = 1 ]; then
  (cd /tmp/pkg/kvbridge && env ${V[$BEST]} timeout ${SERVE_TIMEOUT:-300} python3 -m kvbridge.bench serve --phases C \
    --prompts 8192 --repeat 2 --json $D/serve_tcp.json 2>&1 | grep -v '^{' | tail -25) | tee $D/serve.log
fi
echo "done in ${SECONDS}s"
