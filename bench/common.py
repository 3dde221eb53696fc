"""Helpers shared by the benchmarks (and tests): position-dependent patterns, a result table, JSON output,
samples read from a Prometheus /metrics text."""

from __future__ import annotations

import json
import os
import platform
import re
import time
from typing import Any

import numpy as np


def pattern(nbytes: int, seed: int) -> np.ndarray:
    """nbytes of position-dependent values (8-byte words, none zero), as uint8."""
    words = np.arange(nbytes // 8, dtype=np.int64) * 0x9E3779B1 + (seed << 40) + 0x5DEECE66D
    return words.view(np.uint8)


def table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    fmt = {k: (lambda v: f"{v:.2f}" if isinstance(v, float) else str(v)) for k in cols}
    cells = [[fmt[c](r.get(c, "")) for c in cols] for r in rows]
    w = [max(len(c), *(len(x[i]) for x in cells)) if cells else len(c) for i, c in enumerate(cols)]
    out = ["  ".join(c.rjust(w[i]) for i, c in enumerate(cols))]
    out += ["  ".join(x[i].rjust(w[i]) for i in range(len(cols))) for x in cells]
    return "\n".join(out)


def write_json(path: str | None, rows: list[dict[str, Any]]) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {path}")


def output_args(ap) -> None:
    """--json PATH and --png PATH (default: the JSON's path with .png) on a bench's argument parser."""
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None, help="default: the --json path with .png")


def finish(rows: list[dict[str, Any]], a, png) -> None:
    """Print the rows as one table; with --json, write them there and draw png(path, rows) beside them."""
    print(table(rows, list(rows[0])))
    if a.json:
        write_json(a.json, rows)
        png(a.png or os.path.splitext(a.json)[0] + ".png", rows)


def machine() -> str:
    return f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, {time.strftime('%Y-%m-%d')}"


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})? (\S+)(?: -?\d+)?$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def metric_samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample named exactly `name` in a Prometheus exposition text."""
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) == name:
            out.append((dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))))
    return out


def metric_sum(text: str, name: str) -> float:
    """The sum of every sample named `name` (a counter over all its label sets)."""
    return sum(v for _, v in metric_samples(text, name))


def metric_by(text: str, name: str, label: str) -> dict[str, float]:
    """label value -> sample value for the samples named `name` (one per value of `label`)."""
    return {labels[label]: v for labels, v in metric_samples(text, name) if label in labels}
