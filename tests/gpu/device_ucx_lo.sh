#!/usr/bin/env bash
# Session 19: `kvbridge bench serve` phase A (NIXL direct and staged, cuda_ipc) with the launcher's one-host UCX
# default (UCX_NET_DEVICES=lo) against the old behaviour (UCX_NET_DEVICES=all, every device), one lease.
set -uo pipefail
O=$OUT
ARGS="--phases A --prompts 4096 --repeat 2 --agents nixl/direct,nixl/staged,cuda_ipc/direct --requests 4
      --concurrency 2 --load-tokens 1024 --max-tokens 8"
for v in lo all lo2; do
  mkdir -p $O/$v
  if [ $v = all ]; then export UCX_NET_DEVICES=all; else unset UCX_NET_DEVICES; fi
  OUT=$O/$v BENCH_TIMEOUT=170 bash tests/gpu/device_serve.sh $ARGS > $O/$v/run.log 2>&1
  tail -25 $O/$v/serve.log
done
