"""What a plan produces: fragment arrays (Fragments), the grid form of a uniform plan (GridPlan), and merging
neighbours that are contiguous on both sides (coalesce). Plain numpy values; the planner makes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..agents.memory import int_sum

__all__ = ["Fragments", "GridPlan", "coalesce"]


@dataclass(frozen=True, slots=True, eq=False)
class Fragments:
    """Byte ranges to copy: fragment i is `length[i]` bytes from `src[i]` to `dst[i]` (int64 arrays)."""

    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray

    def __len__(self) -> int:
        return int(self.src.shape[0])

    @property
    def nbytes(self) -> int:
        return int_sum(self.length)

    @property
    def mean_bytes(self) -> float:
        """Mean fragment size in bytes (0.0 when empty)."""
        return self.nbytes / len(self) if len(self) else 0.0

    @staticmethod
    def empty() -> "Fragments":
        z = np.zeros(0, dtype=np.int64)
        return Fragments(z, z, z)

    @staticmethod
    def concat(parts: list["Fragments"]) -> "Fragments":
        parts = [p for p in parts if len(p)]
        if not parts:
            return Fragments.empty()
        if len(parts) == 1:
            return parts[0]
        return Fragments(np.concatenate([p.src for p in parts]), np.concatenate([p.dst for p in parts]),
                         np.concatenate([p.length for p in parts]))


@dataclass(frozen=True, slots=True, eq=False)
class GridPlan:
    """A plan whose fragments all have one length and form a sum grid: fragment i * r + j (r = len(src_inner))
    copies `length` bytes from src_outer[i] + src_inner[j] to dst_outer[i] + dst_inner[j]. The same fragments,
    in the same order, as `plan_piece` gives (`fragments()` lists them); the arrays may be shared with the
    plan cache: read them, never write them."""

    src_outer: np.ndarray
    src_inner: np.ndarray
    dst_outer: np.ndarray
    dst_inner: np.ndarray
    length: int

    def __len__(self) -> int:
        return int(self.src_outer.size * self.src_inner.size)

    @property
    def nbytes(self) -> int:
        return len(self) * self.length

    def fragments(self) -> Fragments:
        """The fragments listed (new arrays)."""
        src = (self.src_outer[:, None] + self.src_inner[None, :]).ravel()
        dst = (self.dst_outer[:, None] + self.dst_inner[None, :]).ravel()
        return Fragments(src, dst, np.full(src.size, self.length, dtype=np.int64))


def coalesce(f: Fragments) -> Fragments:
    """Merge neighbours (in array order) that are contiguous on both sides. Vectorised."""
    n = len(f)
    if n < 2:
        return f
    brk = np.empty(n, dtype=bool)
    brk[0] = True
    end_s = f.src[:-1] + f.length[:-1]
    end_d = f.dst[:-1] + f.length[:-1]
    np.not_equal(end_s, f.src[1:], out=brk[1:])
    brk[1:] |= end_d != f.dst[1:]
    starts = np.flatnonzero(brk)
    if starts.size == n:
        return f
    return Fragments(f.src[starts], f.dst[starts], np.add.reduceat(f.length, starts))
