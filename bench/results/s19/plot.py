"""bench/results/s19: the 1 GiB direct path with a GPU per rank and with the two-GPU placement (spread/, 4x H100),
and the two-stream experiment (streams/, another 4x H100 host) of bench/RESULTS.md "Session 16". Writes s19.json
(per cell: every later request's GB/s, min, median, max, how many reach 300) and s19.png; and, from the py-spy
profiles in profile/, the share of the GIL time of the generation rank's main steps (profile.json +
profile.png).

    .venv/bin/python bench/results/s19/plot.py        (from the repo root; reads the .jsonl files below it)
"""

import collections
import gzip
import json
import os
import statistics

from kvbridge.bench.plot import save_plot

HERE = os.path.dirname(os.path.abspath(__file__))
CELLS = [("spread", f"direct_{p}.jsonl", p, split) for p in ("shared", "spread") for split in ((1, 2), (2, 1))]
CELLS += [("streams", f"streams_{v}_{p}.jsonl", f"{p}, {v}", (2, 1)) for p in ("shared", "spread")
          for v in ("default", "s2", "s2mb66")]


def main() -> None:
    summary = {}
    for folder, name, label, (c, g) in CELLS:
        with open(os.path.join(HERE, folder, name)) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        gb = [r["gbps"] for r in rows if (r["ctx_tp"], r["gen_tp"]) == (c, g) and r["request"] > 1]
        summary[f"{folder}: TP{c} -> TP{g}, {label}"] = {
            "gbps": gb, "min": min(gb), "median": statistics.median(gb), "max": max(gb),
            "at_least_300": sum(x >= 300 for x in gb), "requests": len(gb), "all_ok": all(r["ok"] for r in rows)}

    def draw(fig):
        ax = fig.subplots()
        names = list(summary)
        for i, n in enumerate(names):
            s = summary[n]
            ax.scatter([i] * len(s["gbps"]), s["gbps"], s=8, alpha=0.6)
            ax.plot([i - 0.3, i + 0.3], [s["median"]] * 2, "k-", lw=1.5)
        ax.axhline(300, color="grey", ls="--", lw=0.8, label="goal 300 GB/s")
        ax.set_xticks(range(len(names)), [n.replace(": ", "\n") for n in names], fontsize=7, rotation=20,
                      ha="right")
        ax.set(ylabel="GB/s, 1 GiB request (slowest rank)")
        ax.legend(fontsize=8)

    save_plot(os.path.join(HERE, "s19.png"), draw, "cuda_ipc direct path, 4x H100: placement and streams",
              size=(12.0, 5.5))
    with open(os.path.join(HERE, "s19.json"), "w") as f:
        json.dump(summary, f, indent=1)
    for n, s in summary.items():
        print(n, {k: s[k] for k in ("min", "median", "max", "at_least_300", "requests", "all_ok")})


STEPS = ["IOThread._run", "Handshake._send_fetch", "Pull.post_ready_layers", "NixlAgent._post",
         "Receiver._step_confirm", "Receiver._complete", "_gen_main", "DisaggParams.from_dict", "Histogram.observe"]


def profile() -> None:
    """Share (%) of the sampled GIL time spent inside each step (py-spy raw: `frame;frame;... count` lines)."""
    shares = {}
    for name in ("h100_prof_gil_1", "h100_prof_gil_2", "box_prof_gil"):
        total, inside = 0, collections.Counter()
        with gzip.open(os.path.join(HERE, "profile", f"{name}.txt.gz"), "rt") as f:
            for line in f:
                stack, _, n = line.rstrip().rpartition(" ")
                total += int(n)
                for fn in {frame.split(" (")[0] for frame in stack.split(";")}:
                    inside[fn] += int(n)
        shares[name] = {fn: round(100 * inside[fn] / total, 1) for fn in STEPS}

    def draw(fig):
        ax = fig.subplots()
        for i, (name, sh) in enumerate(shares.items()):
            ax.bar([x + 0.27 * (i - 1) for x in range(len(STEPS))], [sh[fn] for fn in STEPS], 0.27, label=name)
        ax.set_xticks(range(len(STEPS)), STEPS, fontsize=7, rotation=20, ha="right")
        ax.set(ylabel="% of the GIL time (inclusive)")
        ax.legend(fontsize=8)

    save_plot(os.path.join(HERE, "profile.png"), draw, "generation rank at 64 in flight: where the GIL time goes")
    with open(os.path.join(HERE, "profile.json"), "w") as f:
        json.dump(shares, f, indent=1)


if __name__ == "__main__":
    main()
    profile()
