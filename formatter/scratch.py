"""Reused memory for plans: arrays handed back once the transfers that read them have settled.

A 1 GiB request's plan is a few hundred KiB of int64 per leg; a fresh numpy array of that size is new memory
from the kernel, and its page faults cost more than the arithmetic that fills it (bench/RESULTS.md, "Direct
path host work"). A PlanScratch keeps such arrays for the next plan. Used by one thread at a time (a receiver's,
by whichever thread holds its turn lock); no locking. Never hands out an array that was not given back, so a buffer is reused only after its
owner said nothing reads it any more.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import numpy as np

__all__ = ["PlanScratch"]


class PlanScratch:
    """Arrays for plans, handed back once their transfers settled (one owner thread).

    `rows(n, k)` gives a k x n int64 array, from a buffer given back earlier when one is large enough (its
    pages are mapped already: a fresh array of a 1 GiB request's plan costs more in page faults than in
    arithmetic); `give(buf)` returns it, once nothing can read it any more (every transfer that used the
    fragments has settled). `constant(n, v)` is a shared read-only array of n copies of v (the lengths of a
    plan whose fragments are all one size). At most `keep_bytes` of buffers are kept.
    """

    def __init__(self, keep_bytes: int = 64 << 20, keep_constants: int = 16) -> None:
        self._free: list[np.ndarray] = []
        # buffers handed out by `rows` and not given back (weakly: one never given back is simply freed)
        self._lent: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._keep_bytes, self._keep_constants = keep_bytes, keep_constants
        self._constants: OrderedDict = OrderedDict()

    def rows(self, n: int, k: int) -> np.ndarray:
        """A k x n int64 array (its contents are whatever was there)."""
        fits = [i for i, b in enumerate(self._free) if b.size >= n * k]
        if fits:
            buf = self._free.pop(min(fits, key=lambda i: self._free[i].size))
        else:
            buf = np.empty(max(n * k, 1), dtype=np.int64)
        self._lent[id(buf)] = buf
        return buf[:n * k].reshape(k, n)

    def give(self, arr: np.ndarray) -> None:
        """Hand back what `rows` gave (or any view of it): it may be handed out again. Anything else, or a
        buffer given back already, is ignored."""
        if not self._lent:  # nothing lent (plans of a few fragments use none): nothing to take back
            return
        buf = arr
        while buf.base is not None:
            buf = buf.base
        if self._lent.pop(id(buf), None) is None:
            return
        self._free.append(buf)
        while sum(b.nbytes for b in self._free) > self._keep_bytes:
            self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].size))

    @property
    def lent(self) -> int:
        """Buffers handed out and not given back."""
        return len(self._lent)

    def constant(self, n: int, value: int) -> np.ndarray:
        key = (n, value)
        arr = self._constants.get(key)
        if arr is None:
            arr = np.full(n, value, dtype=np.int64)
            arr.flags.writeable = False
            self._constants[key] = arr
            while len(self._constants) > self._keep_constants:
                self._constants.popitem(last=False)
        else:
            self._constants.move_to_end(key)
        return arr
