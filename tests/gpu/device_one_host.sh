#!/usr/bin/env bash
# Session 19: what a one-host deployment with CUDA executors listens on (the launcher's UCX_NET_DEVICES=lo
# and NCCL_SOCKET_IFNAME=lo), against the old interfaces; then bench serve phase B (context TP2 over NCCL)
# with the new defaults. Rows in $OUT.
set -uo pipefail
source tests/gpu/device_prelude.sh
ip -4 -o addr >> $OUT/env.txt 2>&1
echo "== new defaults"
timeout 200 python3 -m kvbridge.tests.gpu.one_host_listeners --json $OUT/listeners_new.json \
  > $OUT/listeners_new.log 2>&1
echo "rc=$?"; tail -1 $OUT/listeners_new.log
echo "== old interfaces (UCX every device, NCCL's own default)"
UCX_NET_DEVICES=all NCCL_SOCKET_IFNAME='^docker,lo' timeout 200 \
  python3 -m kvbridge.tests.gpu.one_host_listeners --json $OUT/listeners_old.json > $OUT/listeners_old.log 2>&1
echo "rc=$?"; tail -1 $OUT/listeners_old.log
echo "== bench serve phase B"
timeout 280 python3 -m kvbridge.bench serve --phases B --prompts 1024 --repeat 2 --max-tokens 8 \
  --json $OUT/serve_b.json > $OUT/serve_b.log 2>&1
echo "rc=$?"; tail -12 $OUT/serve_b.log
