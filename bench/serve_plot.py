"""The PNG of `kvbridge bench serve` (bench/serve.py): exposed time and TTFT per prompt length of the matching-layout
rows, or one bar per row for a run of phases B / C only."""

from __future__ import annotations

from .plot import save_plot


def png(path: str, res: dict) -> None:
    """Exposed time per prompt length (TP1 -> TP1 rows) and TTFT; bars per row where there is no such row."""
    rows = [r for r in res["rows"] if r["layout"] == "tp1->tp1" and r["agent"] != "nixl-tcp"]
    if not rows:  # phases B / C only: one bar per row
        _png_bars(path, res)
        return

    def draw(fig) -> None:
        ax = fig.add_subplot(1, 2, 1)
        for (ag, p, st), mk in zip(sorted({(r["agent"], r["path"], r["streaming"]) for r in rows}), "os^vD<>x"):
            pts = [(r["prompt_tokens"], r["exposed_ms"]) for r in rows if (r["agent"], r["path"], r["streaming"])
                   == (ag, p, st)]
            ax.plot(*zip(*pts), marker=mk, label=f"{ag}/{p} {'overlap' if st else 'sequential'}")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("exposed ms (first decode step - prefill end)")
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=7)
        ax = fig.add_subplot(1, 2, 2)
        agg = sorted({(r["prompt_tokens"], r["ttft_agg_ms"]) for r in rows})
        ax.plot(*zip(*agg), marker="o", color="black", label="aggregated")
        on = [(r["prompt_tokens"], r["ttft_disagg_ms"]) for r in rows if r["streaming"] and r["agent"] == rows[0]
              ["agent"] and r["path"] == "direct"]
        if on:
            ax.plot(*zip(*on), marker="s", label=f"disaggregated {rows[0]['agent']}, overlap")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("TTFT ms")
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=7)

    save_plot(path, draw, f"kvbridge bench serve: {res['model'][:60]}")


def _png_bars(path: str, res: dict) -> None:
    rows = res["rows"]

    def draw(fig) -> None:
        ax = fig.add_subplot(1, 1, 1)
        names = [f"{r['layout']} {r['agent']}/{r['path']}\n{'overlap' if r['streaming'] else 'sequential'}, "
                 f"{r['prompt_tokens']} tok" for r in rows]
        ax.bar(range(len(rows)), [r["exposed_ms"] for r in rows],
               color=["tab:green" if r["streaming"] else "tab:grey" for r in rows])
        ax.axhline(10, color="black", ls="--", lw=1, label="goal with overlap: 10 ms")
        ax.set_xticks(range(len(rows)), names, fontsize=6, rotation=30, ha="right")
        ax.set_ylabel("exposed ms (first decode step - prefill end)")
        ax.legend(fontsize=7)

    save_plot(path, draw, f"kvbridge bench serve: {res['model'][:60]}")
