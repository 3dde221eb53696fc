"""PNG plots beside the benchmarks' JSON (matplotlib, headless). A missing matplotlib skips the plot, saying so."""

from __future__ import annotations

from typing import Callable


def save_plot(path: str, draw: Callable, title: str, size: tuple[float, float] = (11.0, 4.2)) -> bool:
    """Call draw(figure) and save the figure as `path`; False (with a message) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot at {path} (pip install 'kvbridge[bench]')")
        return False
    fig = plt.figure(figsize=size)
    try:
        draw(fig)
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    print(f"wrote {path}")
    return True


def p50_p90_bars(path: str, names: list[str], p50: list[float], p90: list[float], ylabel: str, title: str) -> bool:
    """One bar per row at its p50, a tick at its p90 (bench/control_floor.py, bench/tls_cost.py)."""
    def draw(fig):
        ax = fig.add_subplot(1, 1, 1)
        ax.bar(names, p50, label="p50")
        ax.scatter(names, p90, color="k", marker="_", s=200, label="p90", zorder=3)
        ax.set_ylabel(ylabel)
        ax.legend()

    return save_plot(path, draw, title)
