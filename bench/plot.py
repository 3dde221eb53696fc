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
