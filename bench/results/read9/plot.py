"""The read9 call's rows as one PNG (from the JSON beside this file; no new measurement):
    .venv/bin/python bench/results/read9/plot.py        (from the repo root)"""
import json
import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "..", "..", ".."))  # the folder holding the kvbridge package
from kvbridge.bench.plot import save_plot



def _load(name: str):
    with open(os.path.join(here, name), encoding="utf-8") as f:
        return [json.loads(x) for x in f] if name.endswith(".jsonl") else json.load(f)


ab = _load("read_ab.json")
tc = _load("transfer.json")["rows"]
direct = {t: _load(f"direct_gpu_{t}.jsonl") for t in ("base", "nogrid", "new")}


def draw(fig):
    sizes = list(ab["sizes"])
    ax = fig.add_subplot(1, 3, 1)
    for i, m in enumerate(ab["modes"]):
        ax.bar([x + i * 0.4 for x in range(len(sizes))], [ab["sizes"][s][m]["median_gbps"] for s in sizes], 0.4, label=m)
    ax.set_xticks([x + 0.2 for x in range(len(sizes))], [f"{int(s) >> 10} KiB" for s in sizes], fontsize=7)
    ax.set_ylim(250, 380); ax.set_ylabel("GB/s, median of 12 READs"); ax.set_title("read_ab (one process)", fontsize=9)
    ax.legend(fontsize=7)
    ax = fig.add_subplot(1, 3, 2)
    for tree in ("base", "new"):
        for rnd in (1, 2):
            pts = sorted((r["fragment_bytes"], r["gbps"]) for r in tc
                         if r["tree"] == tree and r["round"] == rnd and r["agent"] == "cuda_ipc")
            ax.plot([p[0] >> 10 for p in pts], [p[1] for p in pts], marker="o", lw=1, ls="-" if tree == "new" else "--",
                    label=f"{tree} r{rnd}")
    ax.set_xscale("log", base=2); ax.set_xlabel("fragment KiB"); ax.set_ylim(280, 380)
    ax.set_title("transfer_cuda (best of 3)", fontsize=9); ax.legend(fontsize=7)
    ax = fig.add_subplot(1, 3, 3)
    for i, t in enumerate(("base", "nogrid", "new")):
        for j, split in enumerate(((2, 1), (1, 2))):
            v = [r["gbps"] for r in direct[t] if (r["ctx_tp"], r["gen_tp"]) == split and r["request"] > 1]
            ax.scatter([j * 4 + i] * len(v), v, label=t if j == 0 else None, color=f"C{i}")
    ax.set_xticks([1, 5], ["TP2 -> TP1", "TP1 -> TP2"]); ax.axhline(300, color="grey", lw=0.5)
    ax.set_title("direct_gpu 1 GiB (requests 2-4)", fontsize=9); ax.legend(fontsize=7)


save_plot(os.path.join(here, "read9.png"), draw, "read9: one cuda_ipc READ and the 1 GiB request (2x H100)")
