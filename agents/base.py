"""The TransferAgent contract: register memory, exchange opaque metadata, one-sided READ/WRITE.

An agent moves bytes and knows nothing of KV caches. Everything above it (formatter, transceiver) speaks to
it through this class only, so a new transport is one subclass plus one registry line.

Lifecycle, and who calls what:

    agent = SomeAgent(name)                         # one per process and memory domain
    reg = agent.register_memory(MemoryRegion(...))  # once per pool; returns a Registration
    blob = agent.metadata()                         # opaque bytes, sent to peers by the control plane
    peer = agent.connect(remote_blob)               # once per peer; returns the peer's name
    h = agent.read(peer, local, remote)             # local <- remote, one-sided, non-blocking
    h.wait(timeout=5.0)                             # raises TransferTimeout / TransferFailed
    h.release()                                     # every handle is released explicitly
    agent.disconnect(peer); reg.release(); agent.close()

Rules every implementation keeps:
- `read`/`write` never block on the data movement; they post it and return a `TransferHandle`.
- `TransferHandle.wait` takes a timeout (seconds) and never waits past it; there is no unbounded wait.
- Local descriptors must lie inside regions registered with this agent; this base class checks that with
  vectorised interval lookups before a subclass sees them. Remote descriptors are checked by the subclass
  against what the peer advertised (or by the transport, as UCX does with its keys).
- `metadata()` and `connect()` handle bytes that came from the network: `connect` validates them and raises
  `PeerError` naming what was wrong; it never unpickles anything.
- Handles and registrations that are garbage-collected without `release()` are released with a warning, not
  a crash (as NIXL's Python API does).

Descriptor lists are two equal-length int64 numpy arrays (addresses, lengths) plus one memory kind and device
for the whole list: no per-fragment Python objects anywhere on the data path.
"""

from __future__ import annotations

import enum
import threading
import time
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..errors import AgentError, PeerError, RegistrationError, TransferFailed, TransferTimeout

__all__ = [
    "MemoryKind",
    "MemoryRegion",
    "DescriptorList",
    "XferState",
    "Registration",
    "TransferHandle",
    "TransferAgent",
    "RegionTable",
]


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


@dataclass(frozen=True, slots=True, eq=False)
class DescriptorList:
    """`len(addrs)` byte ranges on one memory kind/device: range i is `lengths[i]` bytes at `addrs[i]`."""

    addrs: np.ndarray
    lengths: np.ndarray
    kind: MemoryKind = MemoryKind.DRAM
    device: int = 0

    def __post_init__(self) -> None:
        addrs = np.ascontiguousarray(self.addrs, dtype=np.int64)
        lengths = np.ascontiguousarray(self.lengths, dtype=np.int64)
        if addrs.ndim != 1 or lengths.shape != addrs.shape:
            raise AgentError(
                f"descriptor arrays must be 1-D and of equal length, got {addrs.shape} and {lengths.shape}"
            )
        if addrs.size and (lengths.min() <= 0 or addrs.min() <= 0):
            raise AgentError("descriptors need positive addresses and lengths")
        object.__setattr__(self, "addrs", addrs)
        object.__setattr__(self, "lengths", lengths)

    def __len__(self) -> int:
        return int(self.addrs.shape[0])

    def __getitem__(self, sl: slice) -> "DescriptorList":
        """A contiguous sub-list (views of the same arrays, no copy, no re-validation)."""
        if not isinstance(sl, slice):
            raise TypeError("DescriptorList supports slices only")
        sub = object.__new__(DescriptorList)
        for f, v in (("addrs", self.addrs[sl]), ("lengths", self.lengths[sl]), ("kind", self.kind),
                     ("device", self.device)):
            object.__setattr__(sub, f, v)
        return sub

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())

    def as_nixl(self) -> np.ndarray:
        """The N x 3 (addr, len, device) array that NIXL's descriptor lists take."""
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
        self._cache: dict[tuple[MemoryKind, int], tuple[np.ndarray, np.ndarray]] = {}

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
        with self._lock:
            hit = self._cache.get((kind, device))
            if hit is None:
                rs = sorted((r.addr, r.addr + r.length) for r in self._regions.values()
                            if r.kind is kind and r.device == device)
                starts = np.array([a for a, _ in rs], dtype=np.int64)
                ends = np.array([e for _, e in rs], dtype=np.int64)
                hit = self._cache[(kind, device)] = (starts, ends)
            return hit

    def check(self, descs: DescriptorList, what: str) -> None:
        """Raise RegistrationError unless every descriptor lies inside one registered region."""
        if not len(descs):
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


class _Releasable:
    """Explicit release, idempotent, with a warning (not a crash) when garbage-collected unreleased."""

    _released: bool = True

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._do_release()

    def _do_release(self) -> None:  # pragma: no cover - overridden
        pass

    @property
    def released(self) -> bool:
        return self._released

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:
        if not getattr(self, "_released", True):
            warnings.warn(f"{type(self).__name__} was not released; releasing it now", ResourceWarning,
                          stacklevel=2)
            try:
                self.release()
            except Exception:  # noqa: BLE001 - never raise from a finalizer
                pass


class Registration(_Releasable):
    """A registered memory region; `release()` deregisters it."""

    def __init__(self, agent: "TransferAgent", region: MemoryRegion, key: int) -> None:
        self.agent = agent
        self.region = region
        self.key = key
        self._released = False

    def _do_release(self) -> None:
        self.agent._deregister(self)

    def __repr__(self) -> str:
        return f"Registration({self.region}, released={self._released})"


class TransferHandle(_Releasable, ABC):
    """One posted READ or WRITE. Poll `state()`, or `wait(timeout)`; always `release()` it."""

    def __init__(self, num_descriptors: int, nbytes: int) -> None:
        self.num_descriptors = num_descriptors
        self.nbytes = nbytes
        self.error: str | None = None
        self.posted_at = time.monotonic()
        self._released = False

    @abstractmethod
    def state(self) -> XferState:
        """PENDING, DONE or FAILED; never blocks. After FAILED, `error` says why."""

    def cancel(self) -> None:
        """Abort the transfer if it is still running (best effort); its state becomes FAILED."""
        if self.state() is XferState.PENDING:
            self._cancel()
            self.error = self.error or "cancelled"

    def _cancel(self) -> None:  # pragma: no cover - overridden where the transport can abort
        pass

    def wait(self, timeout: float, poll_interval: float = 0.0) -> None:
        """Block until DONE; raise TransferFailed if it fails, TransferTimeout once `timeout` seconds pass.

        Args:
            timeout: seconds to wait at most (required: no unbounded waits in kvbridge).
            poll_interval: seconds to sleep between polls; 0 spins with a yield (lowest latency).
        """
        deadline = time.monotonic() + max(0.0, float(timeout))
        spins = 0
        while True:
            st = self.state()
            if st is XferState.DONE:
                return
            if st is XferState.FAILED:
                raise TransferFailed(f"transfer of {self.nbytes} bytes in {self.num_descriptors} descriptors "
                                     f"failed: {self.error or 'backend reported an error'}")
            if time.monotonic() >= deadline:
                raise TransferTimeout(f"transfer of {self.nbytes} bytes in {self.num_descriptors} descriptors "
                                      f"not done after {timeout:.3g} s")
            spins += 1
            if poll_interval > 0:
                time.sleep(poll_interval)
            elif spins > 1000:
                time.sleep(50e-6)  # back off after a burst of spinning; keeps the GIL available
            else:
                time.sleep(0)

    def _do_release(self) -> None:
        pass


def _chunk_bounds(n: int, chunk: int) -> list[int]:
    """End offsets of pipelined chunks: a first chunk of chunk/8 (data moves early), then `chunk` each."""
    first = max(1, chunk // 8)
    return [first] + list(range(first + chunk, n, chunk)) + [n] if n > first else [n]


def _settle(parts: list["TransferHandle"], timeout: float = 30.0) -> None:
    """Cancel posted parts and wait (bounded) until none is still moving data, then release them."""
    for h in parts:
        h.cancel()
    deadline = time.monotonic() + timeout
    for h in parts:
        while h.state() is XferState.PENDING and time.monotonic() < deadline:
            time.sleep(0.001)
        h.release()


class _ChunkedTransfer(TransferHandle):
    """One transfer posted as several parts; DONE when all are, FAILED as soon as one fails."""

    def __init__(self, parts: list[TransferHandle]) -> None:
        super().__init__(sum(p.num_descriptors for p in parts), sum(p.nbytes for p in parts))
        self._parts = parts

    def state(self) -> XferState:
        pending = False
        for p in self._parts:
            st = p.state()
            if st is XferState.FAILED:
                self.error = self.error or p.error
                return XferState.FAILED
            pending |= st is XferState.PENDING
        return XferState.PENDING if pending else XferState.DONE

    def _cancel(self) -> None:
        for p in self._parts:
            p.cancel()

    def _do_release(self) -> None:
        for p in self._parts:
            p.release()


class TransferAgent(ABC):
    """Base class of every byte mover. Subclasses implement the `_`-prefixed hooks; see the module docstring.

    Class attributes a subclass sets:
        agent_kind: the registry name ("nixl", "cuda_ipc", ...); also written into `metadata()`.
        memory_kinds: the memory kinds it can move.
    """

    agent_kind: ClassVar[str] = "abstract"
    memory_kinds: ClassVar[frozenset[MemoryKind]] = frozenset({MemoryKind.DRAM})
    post_chunk: ClassVar[int] = 0  # >0: post long descriptor lists as pipelined chunks of at most this many

    def __init__(self, name: str) -> None:
        if not name or not isinstance(name, str):
            raise AgentError("an agent needs a non-empty name, unique among its peers")
        self.name = name
        self._regions = RegionTable()
        self._next_key = 0
        self._peers: set[str] = set()
        self._closed = False
        self._lock = threading.RLock()

    # --- memory ---------------------------------------------------------------------------------------
    def register_memory(self, region: MemoryRegion) -> Registration:
        """Register a region so it can be the local side of transfers and be read/written by peers.

        Args:
            region: the bytes to register (see `MemoryRegion.of` for tensors and arrays).
        Returns:
            A Registration; `release()` it (or call `deregister_memory`) before freeing the memory.
        """
        self._check_open()
        if region.kind not in self.memory_kinds:
            raise RegistrationError(f"{self.agent_kind} agent cannot register {region.kind.value} memory "
                                    f"(it supports {sorted(k.value for k in self.memory_kinds)})")
        with self._lock:
            key = self._next_key
            self._next_key += 1
            self._register(region, key)
            self._regions.add(key, region)
        return Registration(self, region, key)

    def deregister_memory(self, registration: Registration) -> None:
        """Deregister a region (same as `registration.release()`)."""
        registration.release()

    def _deregister(self, registration: Registration) -> None:
        with self._lock:
            if self._regions.remove(registration.key) is not None and not self._closed:
                self._unregister(registration.region, registration.key)

    def registered_regions(self) -> list[MemoryRegion]:
        return self._regions.regions()

    # --- peers ----------------------------------------------------------------------------------------
    def metadata(self) -> bytes:
        """Opaque bytes a peer passes to `connect` to reach this agent and its registered memory.

        Call it after registering memory: the blob describes the regions registered at the time.
        """
        self._check_open()
        return self._metadata()

    def connect(self, peer_metadata: bytes) -> str:
        """Learn a peer from its `metadata()` bytes; returns the peer's name. Raises PeerError if malformed."""
        self._check_open()
        if not isinstance(peer_metadata, (bytes, bytearray, memoryview)) or not peer_metadata:
            raise PeerError("peer metadata must be non-empty bytes")
        peer = self._connect(bytes(peer_metadata))
        with self._lock:
            self._peers.add(peer)
        return peer

    def disconnect(self, peer: str) -> None:
        """Forget a peer; later transfers naming it raise PeerError. Unknown peers are ignored."""
        with self._lock:
            known = peer in self._peers
            self._peers.discard(peer)
        if known and not self._closed:
            self._disconnect(peer)

    @property
    def peers(self) -> frozenset[str]:
        return frozenset(self._peers)

    # --- transfers ------------------------------------------------------------------------------------
    def read(self, peer: str, local: DescriptorList, remote: DescriptorList) -> TransferHandle:
        """Post a one-sided READ: remote[i] -> local[i] for every i. Returns at once with a handle."""
        return self._transfer("READ", peer, local, remote)

    def write(self, peer: str, local: DescriptorList, remote: DescriptorList) -> TransferHandle:
        """Post a one-sided WRITE: local[i] -> remote[i] for every i. Returns at once with a handle."""
        return self._transfer("WRITE", peer, local, remote)

    def _transfer(self, op: str, peer: str, local: DescriptorList, remote: DescriptorList) -> TransferHandle:
        self._check_open()
        if peer not in self._peers:
            raise PeerError(f"{op} names peer {peer!r}, which this agent is not connected to")
        if len(local) != len(remote):
            raise AgentError(f"{op}: {len(local)} local descriptors but {len(remote)} remote ones")
        if not np.array_equal(local.lengths, remote.lengths):
            bad = int(np.argmax(local.lengths != remote.lengths))
            raise AgentError(f"{op}: descriptor {bad} is {local.lengths[bad]} bytes locally but "
                             f"{remote.lengths[bad]} remotely")
        for d, side in ((local, "local"), (remote, "remote")):
            if d.kind not in self.memory_kinds:
                raise AgentError(f"{op}: {self.agent_kind} agent cannot move {side} {d.kind.value} memory")
        n = len(local)
        if not self.post_chunk or n <= self.post_chunk:
            self._regions.check(local, f"{op} local side")
            return self._post(op, peer, local, remote)
        # Pipelined posting: check and post the list chunk by chunk, so the host work on chunk i+1 overlaps
        # the transfer of chunk i. The first chunk is small so data starts moving at once.
        parts: list[TransferHandle] = []
        a = 0
        try:
            for b in _chunk_bounds(n, self.post_chunk):
                lo, ro = local[a:b], remote[a:b]
                self._regions.check(lo, f"{op} local side (descriptors {a}..{b - 1})")
                parts.append(self._post(op, peer, lo, ro))
                a = b
        except BaseException:
            _settle(parts)  # nothing may still be moving when the caller sees the error
            raise
        return _ChunkedTransfer(parts)

    # --- teardown -------------------------------------------------------------------------------------
    def close(self) -> None:
        """Release the agent's transport resources. Registrations and peers are dropped."""
        if self._closed:
            return
        with self._lock:
            self._closed = True
            self._close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise AgentError(f"{self.agent_kind} agent {self.name!r} is closed")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, peers={len(self._peers)}, regions={len(self._regions)})"

    # --- hooks for subclasses -------------------------------------------------------------------------
    @abstractmethod
    def _register(self, region: MemoryRegion, key: int) -> None:
        """Register `region` with the transport (`key` identifies it until `_unregister`)."""

    @abstractmethod
    def _unregister(self, region: MemoryRegion, key: int) -> None:
        """Undo `_register`."""

    @abstractmethod
    def _metadata(self) -> bytes:
        """Bytes describing this agent and its registered regions for a peer's `_connect`."""

    @abstractmethod
    def _connect(self, peer_metadata: bytes) -> str:
        """Validate and load a peer's metadata; return its name. Raise PeerError naming what is wrong."""

    @abstractmethod
    def _disconnect(self, peer: str) -> None:
        """Forget a peer's transport state."""

    @abstractmethod
    def _post(self, op: str, peer: str, local: DescriptorList, remote: DescriptorList) -> TransferHandle:
        """Post the (already validated) transfer; never block on data movement."""

    def _close(self) -> None:
        """Release transport resources (optional)."""
