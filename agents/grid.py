"""DescriptorGrid: byte ranges of one length laid out as a sum grid, checked and staged without listing them.

A KV plan between scattered blocks is, per piece, (layer, K/V) offsets x block bases: range i * r + j starts at
outer[i] + inner[j] (r = len(inner)) and every range has one length. A grid says exactly that, so an agent
that understands it bounds-checks the whole list from the extremes of two short arrays and writes addresses
straight into its own staging (cuda_ipc), and one that does not gets the same ranges as a DescriptorList
(`to_list`, the order is row-major, as the planner's Fragments). Plain values and numpy; no transport.

Never trusts its extremes blindly: a grid whose span [lo, hi + length) is not inside one registered region
is checked range by range (`to_list`), which names the first bad range.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import AgentError
from .memory import DescriptorList, MemoryKind

__all__ = ["DescriptorGrid"]


def _frozen(a) -> np.ndarray:
    out = np.array(a, dtype=np.int64, copy=True, order="C")
    out.flags.writeable = False
    return out


@dataclass(frozen=True, slots=True, eq=False)
class DescriptorGrid:
    """len(outer) x len(inner) ranges of `length` bytes on one memory kind/device: range i * len(inner) + j is
    at outer[i] + inner[j].

    Raises:
        AgentError: arrays not 1-D integers, a length below 1, or an address not in (0, 2**63).
    """

    outer: np.ndarray
    inner: np.ndarray
    length: int
    kind: MemoryKind = MemoryKind.DRAM
    device: int = 0
    _bounds: tuple = field(init=False, repr=False, default=(0, 0))

    def __post_init__(self) -> None:
        # private read-only copies (a few hundred entries): the extremes computed here stay true
        outer, inner = (_frozen(a) for a in (self.outer, self.inner))
        if outer.ndim != 1 or inner.ndim != 1:
            raise AgentError(f"a descriptor grid needs 1-D outer and inner arrays, got {outer.shape} and "
                             f"{inner.shape}")
        if isinstance(self.length, bool) or not isinstance(self.length, (int, np.integer)) or self.length < 1:
            raise AgentError(f"a descriptor grid's length must be a positive int, got {self.length!r}")
        object.__setattr__(self, "outer", outer)
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "length", int(self.length))
        self._set_bounds()
        lo, hi = self._bounds
        if outer.size and inner.size and (lo <= 0 or hi + self.length >= 1 << 63):
            raise AgentError(f"descriptor grid addresses must lie in (0, 2**63), got {lo:#x}..{hi:#x}")

    def _set_bounds(self) -> None:
        o, i = self.outer, self.inner
        b = (int(o.min()) + int(i.min()), int(o.max()) + int(i.max())) if o.size and i.size else (0, 0)
        object.__setattr__(self, "_bounds", b)

    def __len__(self) -> int:
        return int(self.outer.size * self.inner.size)

    @property
    def nbytes(self) -> int:
        return len(self) * self.length

    def bounds(self) -> tuple[int, int]:
        """(lowest, highest) start address of the ranges (exact: each is a sum of one outer and one inner)."""
        return self._bounds

    def rows(self, a: int, b: int) -> "DescriptorGrid":
        """The ranges of outer rows [a, b): a grid of the same inner (views of the read-only arrays)."""
        sub = object.__new__(DescriptorGrid)
        for f, v in (("outer", self.outer[a:b]), ("inner", self.inner), ("length", self.length),
                     ("kind", self.kind), ("device", self.device)):
            object.__setattr__(sub, f, v)
        sub._set_bounds()
        return sub

    def write(self, out: np.ndarray, delta: int = 0) -> None:
        """Write every range's address (+ delta) into `out` (len(self) int64, e.g. pinned staging), in order."""
        k, r = self.outer.size, self.inner.size
        np.add((self.outer + delta)[:, None] if delta else self.outer[:, None], self.inner[None, :],
               out=out.reshape(k, r))

    def write_axes(self, out: np.ndarray, delta: int = 0) -> None:
        """Write outer (+ delta) then inner into `out` (len(outer) + len(inner) int64): the grid kernel's table."""
        k = self.outer.size
        np.add(self.outer, delta, out=out[:k])
        out[k:k + self.inner.size] = self.inner

    def to_list(self) -> DescriptorList:
        """The same ranges as a DescriptorList (row-major: outer-major, inner-minor)."""
        addrs = np.empty(len(self), dtype=np.int64)
        self.write(addrs)
        return DescriptorList(addrs, np.full(addrs.size, self.length, dtype=np.int64), self.kind, self.device)
