"""`python -m kvbridge.bench.route_trace TRACE [--policy P] [--workload W]`: where a policy's prefill tokens
went against the oracle's, request by request, from `kvbridge bench route --trace TRACE`.

Each trace line is one request: its prompt length, what every worker held of it as it left (`oracle_held`,
the bench's index of the workers' own KV events), the oracle's hit, and the answer's route (`route`: the
chosen workers and the router's view of every candidate; `context_reused_tokens` / `reused_tokens`: what the
context worker, or a generation worker that prefilled the tail itself, really reused). A request computed
more than the oracle's for one of these causes (the first that applies):

    generation worker held less   the chosen generation worker held less of the prompt than another one that
                                  could have prefilled the tail itself (or than the one that held most)
    local prefill not taken       a generation worker held all but a short tail, but a context hop ran
    context worker held less      the context hop went to a worker holding less than another context worker
    held, not reused              the chosen worker held what the oracle saw, but computed more (its blocks
                                  were evicted before the prefill, or were speculative: still in flight)

and computed less than the oracle's when a burst of one prefix landed together (speculative entries): the
oracle sees each cache as a request leaves, not as it is scheduled. Reads the trace only.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from typing import Any

from .common import table

__all__ = ["classify", "main"]


def computed(r: dict[str, Any]) -> int:
    """Prompt tokens this request really computed (where it was prefilled)."""
    local = "local_prefill" in (r.get("route") or {})
    return r["prompt_tokens"] - int(r.get("reused_tokens" if local else "context_reused_tokens", 0) or 0)


def classify(r: dict[str, Any], local_tokens: int) -> str:
    """Why request `r` computed more (or less) than the oracle's; "" when it computed the same."""
    extra = computed(r) - (r["prompt_tokens"] - r["oracle_hit"])
    if extra == 0:
        return ""
    if extra < 0:
        return "fewer than the oracle (a burst landed together)"
    route, held, n = r.get("route") or {}, r["oracle_held"], r["prompt_tokens"]
    gens = {w: h for w, h in held.items() if w.startswith("gen")}
    ctxs = {w: h for w, h in held.items() if not w.startswith("gen")}
    g = (route.get("generation") or {}).get("worker") or ""
    ok = {w for w, h in gens.items() if h and n - h <= local_tokens}  # could prefill the tail itself
    if g in gens and any(gens[w] > gens[g] for w in ok | {max(gens, key=gens.get)}):
        return "generation worker held less"
    if "local_prefill" not in route and ok:
        return "local prefill not taken"
    c = r.get("context_worker")
    if c in ctxs and ctxs[c] < max(ctxs.values()):
        return "context worker held less"
    return "held, not reused"


def summarize(rows: list[dict[str, Any]], local_tokens: int) -> list[dict[str, Any]]:
    """One row per cause: requests, extra tokens computed against the oracle."""
    n, extra = Counter(), Counter()
    for r in rows:
        why = classify(r, local_tokens)
        if why:
            n[why] += 1
            extra[why] += computed(r) - (r["prompt_tokens"] - r["oracle_hit"])
    return [{"cause": k, "requests": n[k], "tokens_vs_oracle": extra[k]} for k in n]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvbridge.bench.route_trace", description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--policy", default="kv_aware")
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--local-prefill-tokens", type=int, default=32, help="the deployment's local_prefill_tokens")
    a = ap.parse_args(argv)
    with open(a.trace) as f:
        rows = [r for r in map(json.loads, f) if r["policy"] == a.policy and r["workload"] == a.workload]
    total, oracle = sum(map(computed, rows)), sum(r["prompt_tokens"] - r["oracle_hit"] for r in rows)
    print(f"{a.policy} {a.workload}: {len(rows)} requests, computed {total}, oracle {oracle} "
          f"({total / max(1, oracle):.3f}x)")
    out = summarize(rows, a.local_prefill_tokens)
    if out:
        print(table(out, ["cause", "requests", "tokens_vs_oracle"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
