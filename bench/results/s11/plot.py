"""bench/results/s11: TP1 -> TP2's 1 GiB direct path with generation rank 1's copy kernel on the context's GPU
(cuda_ipc `launch_on="peer"`) against the default, and bench/launch_mix.py's two halves in one process
(bench/RESULTS.md, "Session 8 on 2x H100"). Writes s11.json (per variant: every request's GB/s, median, min,
how many reach 300) and s11.png.

    python bench/results/s11/plot.py        (from the repo root; reads the .jsonl files beside it)
"""

import glob
import json
import os
import statistics

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def load(pattern: str) -> list[dict]:
    out = []
    for path in sorted(glob.glob(os.path.join(HERE, pattern))):
        out += [json.loads(line) for line in open(path) if line.strip()]
    return out


def main() -> None:
    summary = {"direct": {}, "launch_mix": load("launch_mix.jsonl")}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for i, (variant, label) in enumerate((("default", "default (both kernels on GPU0)"),
                                          ("peer", "rank 1 launch_on=peer"),
                                          ("peer66", "rank 1 launch_on=peer, max_blocks=66"))):
        rows = [r for r in load(f"direct_{variant}_call*.jsonl") if r["request"] > 1 and r["ctx_tp"] == 1]
        g = [r["gbps"] for r in rows]
        if not g:
            continue
        summary["direct"][variant] = {"gbps": g, "median": statistics.median(g), "min": min(g),
                                      "at_least_300": sum(x >= 300 for x in g), "requests": len(g),
                                      "all_ok": all(r["ok"] for r in rows)}
        ax1.plot(range(len(g)), g, "o-", ms=3, lw=0.8, label=f"{label}: median {statistics.median(g):.0f}")
    ax1.axhline(300, color="k", ls="--", lw=0.8)
    ax1.set(title="ctx TP1 (GPU1) -> gen TP2 (both on GPU0), 1 GiB a request",
            xlabel="request (later ones, runs in a row)", ylabel="GB/s (slowest rank's read)")
    ax1.legend(fontsize=8)
    mix = summary["launch_mix"]
    for k, frag in enumerate(sorted({r["fragment_bytes"] for r in mix})):
        sub = [r for r in mix if r["fragment_bytes"] == frag]
        ax2.bar([j + 0.4 * k for j in range(len(sub))], [r["gbps"] for r in sub], 0.4, label=f"{frag // 1024} KiB")
        ax2.set_xticks([j + 0.2 for j in range(len(sub))], [r["variant"] for r in sub], rotation=30, ha="right",
                       fontsize=8)
    ax2.set(title="one process: halves of 512 MiB, where each kernel runs", ylabel="GB/s (first post -> last end)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "s11.png"), dpi=110)
    with open(os.path.join(HERE, "s11.json"), "w") as f:
        json.dump(summary, f, indent=1)
    for v, s in summary["direct"].items():
        print(v, {k: s[k] for k in ("median", "min", "at_least_300", "requests", "all_ok")})


if __name__ == "__main__":
    main()
