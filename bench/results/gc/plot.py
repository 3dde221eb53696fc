"""bench/results/gc: the gcwatch lines of `kvbridge demo` (freeze off / on) and of `kvbridge bench vllm --quick`
(bench/RESULTS.md, "Full collections") as JSON, and a PNG of the full collection at exit of each process
that served in the demo (its ranks and workers; the launcher left out).

    python bench/results/gc/plot.py        (from the repo root; reads the .txt files beside it)
"""

import ast
import json
import os
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
LINE = re.compile(r"pid (\d+) '(.*?)' frozen=(\d+)(?: full_at_exit_ms=([\d.]+))? full=(\[.*\])")


def rows(name: str) -> list[dict]:
    out = []
    for line in open(os.path.join(HERE, name)):
        m = LINE.match(line.strip())
        if m:
            full = [dict(zip(("at_s", "ms", "objects"), (float(a[:-1]), float(b[:-2]), int(c))))
                    for a, b, c in (x.split(":") for x in ast.literal_eval(m.group(5)))]
            out.append({"pid": int(m.group(1)), "argv": m.group(2), "frozen": int(m.group(3)),
                        "full_at_exit_ms": float(m.group(4)) if m.group(4) else None, "full": full})
    return out


data = {n[:-4]: rows(n) for n in ("demo_freeze0.txt", "demo_freeze1.txt", "vllm_quick.txt")}
with open(os.path.join(HERE, "gc.json"), "w") as f:
    json.dump(data, f, indent=1)
fig, ax = plt.subplots(figsize=(7, 3.5))
for i, (key, label) in enumerate((("demo_freeze0", "KVBRIDGE_GC_FREEZE=0"), ("demo_freeze1", "default: frozen"))):
    served = [r for r in data[key] if r["full"] or r["frozen"]]
    launcher = min(r["pid"] for r in served)  # `kvbridge demo` itself, started first: serves nothing
    ms = sorted((r["full_at_exit_ms"] for r in served if r["pid"] != launcher), reverse=True)
    ax.bar([j + 0.4 * i for j in range(len(ms))], ms, width=0.4, label=label)
ax.set_ylabel("one full collection, ms")
ax.set_xlabel("kvbridge demo's processes (ranks, workers), slowest first")
ax.set_title("A full garbage collection once served (2-core box)")
ax.legend()
fig.tight_layout()
fig.savefig(os.path.join(HERE, "gc.png"), dpi=110)
