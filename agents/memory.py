"""Memory and descriptors: where bytes live (MemoryRegion), what to move (DescriptorList), and vectorised
bounds checks against registered memory (RegionTable). Plain values and numpy; no transport.
"""

from __future__ import annotations

import bisect
import enum
import threading
from dataclasses import FrozenInstanceError, dataclass

import numpy as np

from ..errors import AgentError, RegistrationError

__all__ = ["MemoryKind", "XferState", "MemoryRegion", "DescriptorList", "RegionTable"]

# Lists of at most this many descriptors are checked with Python ints instead of numpy reductions: the same
# checks, without numpy's fixed cost per call (microseconds, paid per request on the control plane's path).
_SMALL = 16


def int_sum(a: np.ndarray) -> int:
    """a.sum() as a Python int: Python's sum for at most _SMALL entries (numpy's fixed cost per call is larger)."""
    return sum(a.tolist()) if a.size <= _SMALL else int(a.sum())


def int_extremes(a: np.ndarray) -> tuple[int, int]:
    """(min, max) of a non-empty integer array as Python ints: Python's for at most _SMALL entries."""
    if a.size <= _SMALL:
        xs = a.tolist()
        return min(xs), max(xs)
    return int(a.min()), int(a.max())


class MemoryKind(str, enum.Enum):
    """Where a region lives: host memory or the memory of one CUDA device."""

    DRAM = "DRAM"
    VRAM = "VRAM"


class XferState(str, enum.Enum):
    """The whole state vocabulary of a transfer."""

    PENDING = "PENDING"
    DONE = "DONE"
    FAILED = "FAILED"


@dataclass(frozen=True, slots=True)
class MemoryRegion:
    """A contiguous range of bytes: `length` bytes at `addr`, on `device` (0 for DRAM)."""

    addr: int
    length: int
    kind: MemoryKind = MemoryKind.DRAM
    device: int = 0

    def __post_init__(self) -> None:
        if self.addr <= 0 or self.length <= 0:
            raise RegistrationError(f"a memory region needs addr > 0 and length > 0, got {self}")
        if self.kind is MemoryKind.DRAM and self.device != 0:
            raise RegistrationError(f"DRAM regions have device 0, got device {self.device}")

    @classmethod
    def of(cls, buffer) -> "MemoryRegion":
        """The region of a contiguous torch tensor or numpy array (CUDA tensors give VRAM regions)."""
        if isinstance(buffer, np.ndarray):
            if not buffer.flags.c_contiguous:
                raise RegistrationError("only contiguous numpy arrays can be registered")
            return cls(int(buffer.ctypes.data), int(buffer.nbytes))
        if hasattr(buffer, "data_ptr") and hasattr(buffer, "is_contiguous"):
            if not buffer.is_contiguous():
                raise RegistrationError("only contiguous tensors can be registered")
            nbytes = buffer.numel() * buffer.element_size()
            if buffer.device.type == "cuda":
                return cls(int(buffer.data_ptr()), int(nbytes), MemoryKind.VRAM, int(buffer.device.index or 0))
            if buffer.device.type == "cpu":
                return cls(int(buffer.data_ptr()), int(nbytes))
            raise RegistrationError(f"cannot register memory on device {buffer.device}")
        raise RegistrationError(f"cannot register a {type(buffer).__name__}; pass a tensor or ndarray")


class DescriptorList:
    """`len(addrs)` byte ranges on one memory kind/device: range i is `lengths[i]` bytes at `addrs[i]`.

    Immutable (like a frozen dataclass). Shapes and dtypes are checked when it is made; the per-range check
    (every address and length positive: two passes over the arrays) runs once, the first time anything reads
    `addrs` or `lengths` (or `validate()` is called), so it raises the same AgentError, naming the first bad
    range, before any range is used. An agent that checks ranges as it stages them (cuda_ipc: its bounds
    checks and staging already pass over each part) reads the arrays through `raw()` and skips the extra passes.
    """

    __slots__ = ("_addrs", "_base", "_checked", "_lengths", "device", "kind")

    def __init__(self, addrs, lengths, kind: MemoryKind = MemoryKind.DRAM, device: int = 0) -> None:
        addrs = np.ascontiguousarray(addrs, dtype=np.int64)
        lengths = np.ascontiguousarray(lengths, dtype=np.int64)
        if addrs.ndim != 1 or lengths.shape != addrs.shape:
            raise AgentError(
                f"descriptor arrays must be 1-D and of equal length, got {addrs.shape} and {lengths.shape}"
            )
        for f, v in (("_addrs", addrs), ("_lengths", lengths), ("kind", kind), ("device", device),
                     ("_checked", not addrs.size), ("_base", 0)):
            object.__setattr__(self, f, v)

    def __setattr__(self, name, value) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}")

    def __repr__(self) -> str:
        return f"DescriptorList({len(self)} ranges, kind={self.kind.value}, device={self.device})"

    def __reduce__(self):  # copy.copy / deepcopy (made anew: the copy checks its ranges on its own first use)
        return DescriptorList, (self._addrs, self._lengths, self.kind, self.device)

    @property
    def addrs(self) -> np.ndarray:
        if not self._checked:
            self.validate()
        return self._addrs

    @property
    def lengths(self) -> np.ndarray:
        if not self._checked:
            self.validate()
        return self._lengths

    def raw(self) -> tuple[np.ndarray, np.ndarray]:
        """(addrs, lengths) without the per-range check: only for a caller that checks every range itself
        before using it (positive lengths, addresses inside registered memory)."""
        return self._addrs, self._lengths

    def validate(self) -> DescriptorList:
        """Check every range once (AgentError naming the first with an address or length <= 0); returns self."""
        if not self._checked:
            a, n = self._addrs, self._lengths
            small = n.size <= _SMALL  # a few: Python's min beats numpy's call
            if (min(n.tolist()) <= 0 or min(a.tolist()) <= 0) if small else (n.min() <= 0 or a.min() <= 0):
                bad = int(np.argmax((n <= 0) | (a <= 0)))
                raise AgentError(f"descriptors need positive addresses and lengths: descriptor "
                                 f"{self._base + bad} is {int(n[bad])} bytes at {int(a[bad])}")
            object.__setattr__(self, "_checked", True)
        return self

    def __len__(self) -> int:
        return int(self._addrs.shape[0])

    def __getitem__(self, sl: slice) -> "DescriptorList":
        """A contiguous sub-list (views of the same arrays, no copy, no re-validation)."""
        if not isinstance(sl, slice):
            raise TypeError("DescriptorList supports slices only")
        start = sl.indices(len(self))[0] if sl.step in (None, 1) else 0
        sub = object.__new__(DescriptorList)
        a = self._addrs[sl]
        for f, v in (("_addrs", a), ("_lengths", self._lengths[sl]), ("kind", self.kind),
                     ("device", self.device), ("_checked", self._checked or not a.size),
                     ("_base", self._base + start)):
            object.__setattr__(sub, f, v)
        return sub

    @property
    def nbytes(self) -> int:
        return int_sum(self.lengths)

    def as_nixl(self) -> np.ndarray | list[tuple[int, int, int]]:
        """What NIXL's descriptor lists take: (addr, len, device) tuples for a short list (cheaper to build and
        for NIXL to read), else the N x 3 array."""
        if len(self) <= _SMALL:
            dev = self.device
            return [(a, n, dev) for a, n in zip(self.addrs.tolist(), self.lengths.tolist())]
        out = np.empty((len(self), 3), dtype=np.uint64)
        out[:, 0] = self.addrs
        out[:, 1] = self.lengths
        out[:, 2] = self.device
        return out


class RegionTable:
    """Registered regions of one memory kind/device, for vectorised "does every descriptor fit?" checks."""

    def __init__(self) -> None:
        self._regions: dict[int, MemoryRegion] = {}
        self._lock = threading.Lock()
        self._cache: dict[tuple[MemoryKind, int], tuple] = {}  # `_table`'s answers

    def add(self, key: int, region: MemoryRegion) -> None:
        with self._lock:
            self._regions[key] = region
            self._cache.clear()

    def remove(self, key: int) -> MemoryRegion | None:
        with self._lock:
            self._cache.clear()
            return self._regions.pop(key, None)

    def __len__(self) -> int:
        return len(self._regions)

    def regions(self) -> list[MemoryRegion]:
        with self._lock:
            return list(self._regions.values())

    def _sorted(self, kind: MemoryKind, device: int) -> tuple[np.ndarray, np.ndarray]:
        return self._table(kind, device)[:2]

    def _table(self, kind: MemoryKind, device: int) -> tuple[np.ndarray, np.ndarray, list[int], list[int]]:
        """Sorted region starts and ends of `kind` on `device`, as arrays and as lists of Python ints."""
        with self._lock:
            hit = self._cache.get((kind, device))
            if hit is None:
                rs = sorted((r.addr, r.addr + r.length) for r in self._regions.values()
                            if r.kind is kind and r.device == device)
                starts = [a for a, _ in rs]
                ends = [e for _, e in rs]
                hit = self._cache[(kind, device)] = (np.array(starts, dtype=np.int64),
                                                     np.array(ends, dtype=np.int64), starts, ends)
            return hit

    def contains_span(self, kind: MemoryKind, device: int, lo: int, end: int) -> bool:
        """Whether [lo, end) lies inside one registered region of `kind` on `device`."""
        starts, ends = self._sorted(kind, device)
        i = int(np.searchsorted(starts, lo, side="right")) - 1
        return i >= 0 and end <= int(ends[i])

    def check(self, descs: DescriptorList, what: str) -> None:
        """Raise RegistrationError unless every descriptor lies inside one registered region."""
        n = len(descs)
        if not n:
            return
        if n <= _SMALL:  # the same test with Python ints and bisect (no numpy call per descriptor list)
            _, _, starts_l, ends_l = self._table(descs.kind, descs.device)
            if starts_l:
                for a, length in zip(descs.addrs.tolist(), descs.lengths.tolist()):
                    i = bisect.bisect_right(starts_l, a) - 1
                    if i < 0 or a + length > ends_l[i]:
                        break
                else:
                    return
        starts, ends = self._sorted(descs.kind, descs.device)
        if not starts.size:
            raise RegistrationError(f"{what}: no {descs.kind.value} memory registered on device {descs.device}")
        idx = np.searchsorted(starts, descs.addrs, side="right") - 1
        ok = idx >= 0
        ok &= descs.addrs + descs.lengths <= ends[np.maximum(idx, 0)]
        if not ok.all():
            bad = int(np.argmin(ok))
            raise RegistrationError(
                f"{what}: descriptor {bad} ({descs.lengths[bad]} bytes at {descs.addrs[bad]:#x}) is outside "
                f"every registered {descs.kind.value} region on device {descs.device}"
            )
