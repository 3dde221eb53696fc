"""bench/results/s12: TP1 -> TP2's 1 GiB direct path with generation rank 1's copy kernel on the context's GPU, set
through `transceiver.rank_options` (bench/RESULTS.md, "Session 9 on 2x H100"): call 1 (default and peer alternated)
and call 5 (peer and peer + max_blocks=66 alternated, another machine). Writes s12.json (per call and variant:
every request's GB/s, median, min, how many reach 300) and s12.png.

    python bench/results/s12/plot.py        (from the repo root; reads the .jsonl files beside it)
"""

import json
import os
import statistics

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RUNS = (("call 1", "", "default", "default (both kernels on GPU0)"), ("call 1", "", "peer", "rank 1 peer"),
        ("call 5", "call5", "peer", "rank 1 peer"), ("call 5", "call5", "peer66", "rank 1 peer, max_blocks=66"))


def main() -> None:
    summary = {}
    fig, ax = plt.subplots(figsize=(11, 4.8))
    for call, folder, variant, label in RUNS:
        with open(os.path.join(HERE, folder, f"direct_{variant}.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        rows = [r for r in rows if r["request"] > 1]  # request 1 opens handles and compiles: left out
        g = [r["gbps"] for r in rows]
        summary[f"{call} {variant}"] = {"gbps": g, "median": statistics.median(g), "min": min(g),
                                        "at_least_300": sum(x >= 300 for x in g), "requests": len(g),
                                        "all_ok": all(r["ok"] for r in rows)}
        ax.plot(range(len(g)), g, "o-", ms=3, lw=0.8,
                label=f"{call}, {label}: median {statistics.median(g):.0f}, {sum(x >= 300 for x in g)}/{len(g)} >= 300")
    ax.axhline(300, color="k", ls="--", lw=0.8)
    ax.set(title="ctx TP1 (GPU1) -> gen TP2 (both on GPU0), 1 GiB a request, 2x H100",
           xlabel="request (requests 2.. of two runs in a row)", ylabel="GB/s (slowest rank's read)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "s12.png"), dpi=110)
    with open(os.path.join(HERE, "s12.json"), "w") as f:
        json.dump(summary, f, indent=1)
    for v, s in summary.items():
        print(v, {k: s[k] for k in ("median", "min", "at_least_300", "requests", "all_ok")})


if __name__ == "__main__":
    main()
