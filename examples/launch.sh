#!/usr/bin/env bash
# Launch a disaggregated deployment from one serving config.
#
#   examples/launch.sh [CONFIG]              every worker and the router here: `kvbridge serve CONFIG`
#   examples/launch.sh --separate [CONFIG]   the same processes started one by one, as on separate hosts
#
# --separate shows what `kvbridge serve` does for you: each context / generation worker is
# `kvbridge worker --config CONFIG --role ROLE --index I` (run it on the host its url names), the router is
# `kvbridge router --config CONFIG`. Every process reads the same config; ports must be given (not 0), and
# every process gets the same internal token (KVBRIDGE_INTERNAL_TOKEN; made here unless already set).
# Ctrl-C stops them all. Then: python examples/client.py "What is the capital of France?"
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
separate=0
if [[ "${1:-}" == "--separate" ]]; then separate=1; shift; fi
CONFIG=${1:-examples/serve_cpu.yaml}

if [[ $separate == 0 ]]; then
  exec "$PY" -m kvbridge.cli serve "$CONFIG"
fi

export KVBRIDGE_INTERNAL_TOKEN=${KVBRIDGE_INTERNAL_TOKEN:-$("$PY" -c "import secrets; print(secrets.token_urlsafe(32))")}
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait; }
trap cleanup EXIT INT TERM
count() {  # instances of a server group in the config
  "$PY" -c "from kvbridge.serving.config import load_config as l; c = l('$CONFIG'); print(len(c.$1))"
}
for i in $(seq 0 $(( $(count context) - 1 ))); do
  "$PY" -m kvbridge.cli worker --config "$CONFIG" --role context --index "$i" & pids+=($!)
done
for i in $(seq 0 $(( $(count generation) - 1 ))); do
  "$PY" -m kvbridge.cli worker --config "$CONFIG" --role generation --index "$i" & pids+=($!)
done
"$PY" -m kvbridge.cli router --config "$CONFIG" & pids+=($!)
wait -n  # the first process to exit ends the deployment (cleanup stops the others)
echo "launch.sh: a process exited; stopping the others" >&2
exit 1
