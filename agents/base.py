"""The TransferAgent contract: register memory, exchange opaque metadata, one-sided READ/WRITE.

An agent moves bytes and knows nothing of KV caches. Everything above it (formatter, transceiver) speaks to
it through this class only, so a new transport is one subclass plus one registry line.

Lifecycle, and who calls what:

    agent = SomeAgent(name)                         # one per process and memory domain
    reg = agent.register_memory(MemoryRegion(...))  # once per pool; returns a Registration
    blob = agent.metadata()                         # opaque bytes, sent to peers by the control plane
    peer = agent.connect(remote_blob)               # once per peer; returns the peer's name
    h = agent.read(peer, local, remote)             # local <- remote, one-sided, non-blocking
                                                    # (read_grid: the same for DescriptorGrids, see grid.py)
    h.wait(timeout=5.0)                             # raises TransferTimeout / TransferFailed
    h.release()                                     # every handle is released explicitly
    agent.disconnect(peer); reg.release(); agent.close()

Rules every implementation keeps:
- `read`/`write` never block on the data movement; they post it and return a `TransferHandle`.
- `TransferHandle.wait` takes a timeout (seconds) and never waits past it; there is no unbounded wait.
- Local descriptors must lie inside regions registered with this agent; this base class checks that with
  vectorised interval lookups before a subclass sees them. Every range is checked (positive address and
  length: `DescriptorList.validate`) before `_post`, unless the subclass sets `checks_ranges` and refuses bad
  ranges itself in its own passes over each part (cuda_ipc). Remote descriptors are checked by the subclass
  against what the peer advertised (or by the transport, as UCX does with its keys).
- `metadata()` and `connect()` handle bytes that came from the network: `connect` validates them and raises
  `PeerError` naming what was wrong; it never unpickles anything.
- Handles and registrations that are garbage-collected without `release()` are released with a warning, not
  a crash (as NIXL's Python API does).

Threads: who calls each hook, and what it may block on

    hook / method        called from                                  may block on
    -------------------  -------------------------------------------  ------------------------------------
    _register            the caller of register_memory (base lock      pinning/registering with the
    _unregister          held); any thread, also a finalizer           transport; `_unregister` may wait
                                                                       (bounded) for a serving thread
    _metadata/_connect   the control-plane thread that exchanges        nothing remote: parse and store
    _disconnect          metadata (a transceiver's I/O thread)          only; no network round trip
    _post                the thread that posts transfers (the           nothing: enqueue and return a
    _post_grid           transceiver's I/O thread, many in a row)       TransferHandle at once
    handle.state()       any thread, polled in a tight loop             nothing (it is a poll)
    handle.cancel()      any thread, also while another polls state()   nothing; it asks, it does not wait
    handle.wait(t)       the owner of the handle                        at most `t` seconds
    handle.release()     the owner, once settled; or a finalizer        nothing: frees the handle's resources
    _close               the owner, once, after its last transfer       joining its own threads (bounded)

A subclass therefore guards its own tables with its own lock (the base lock serialises register/deregister/
close, not transfers; any name works, `self._lock` included: the base class keeps its own state under
`_kvb_`-prefixed names, `_kvb_lock`, `_kvb_regions`, `_kvb_peers`, `_kvb_closed`, `_kvb_next_key`, which a
subclass must not touch) and never does data movement on the caller's thread: a blocking transport runs the
movement on a pool and returns a `FutureTransfer` (see examples/custom_agent.py).

Remote-descriptor checks. The base class checks the local side (inside this agent's registrations, right
kind, equal lengths, peer connected) before `_post` sees anything. The remote side is the subclass's job:
check it against the regions the peer advertised in its metadata (`RegionTable.check`, vectorised), either
in `_post` (raise AgentError) or in the transport (the handle ends FAILED); a transfer naming memory the peer
never registered must never be DONE. A two-sided transport's serving side checks again what the peer asked
for (`ConnectionAgent.check_served`): never trust the requester.

Cancel semantics. `handle.cancel()` on a PENDING handle asks the transport to stop (the `_cancel` hook) and
returns at once. From then on the handle may stay PENDING only while data already in flight can still land;
once nothing can move any more it is FAILED (its `error` says it was cancelled), never DONE. So a caller that
waits (bounded) for a non-PENDING state after cancel may free or reuse the memory. cancel() on a DONE or
FAILED handle does nothing and returns False. Callers release a handle once it is no longer PENDING (cancel,
then a bounded wait, as `handles.settle_all` does); what releasing a still-PENDING handle does is the
transport's business (ConnectionAgent cancels it), so nothing relies on it.

A peer that dies: transfers to it end FAILED (or raise at post) within the transport's own deadline, never
stay PENDING forever, and the agent keeps serving its other peers. A transport that maps the peer's memory
(CUDA IPC: the allocation stays alive while mapped) may end DONE, with exactly the peer's last bytes.

`kvbridge check-agent MODULE:CLASS` runs the conformance suite (`kvbridge.agents.conformance`) that checks
these rules against a class in real processes.

Descriptor lists are two equal-length int64 numpy arrays (addresses, lengths) plus one memory kind and device
for the whole list: no per-fragment Python objects anywhere on the data path.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np

from ..errors import AgentError, PeerError, RegistrationError
from .grid import DescriptorGrid
from .handles import ChunkedTransfer, Registration, TransferHandle, chunk_bounds, settle_all
from .memory import DescriptorList, MemoryKind, MemoryRegion, RegionTable, XferState

__all__ = [
    "MemoryKind",
    "MemoryRegion",
    "DescriptorList",
    "DescriptorGrid",
    "XferState",
    "Registration",
    "TransferHandle",
    "TransferAgent",
    "RegionTable",
]


def _same_array(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays are views of the same memory with the same shape and strides (equal without a pass
    over them: a planner hands both sides one lengths array)."""
    return a is b or (a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
                      and a.shape == b.shape and a.strides == b.strides and a.dtype == b.dtype)


class TransferAgent(ABC):
    """Base class of every byte mover. Subclasses implement the `_`-prefixed hooks; see the module docstring.

    Class attributes a subclass sets:
        agent_kind: the registry name ("nixl", "cuda_ipc", ...); also written into `metadata()`.
        memory_kinds: the memory kinds it can move.
    """

    agent_kind: ClassVar[str] = "abstract"
    memory_kinds: ClassVar[frozenset[MemoryKind]] = frozenset({MemoryKind.DRAM})
    post_chunk: ClassVar[int] = 0  # >0: post long descriptor lists as pipelined chunks of at most this many
    post_grow: ClassVar[bool | None] = False  # True: the chunks double from post_chunk / 8 up (`_part_ends`)
    grid_native: ClassVar[bool] = False  # True: `_post_grid` takes DescriptorGrids as they are
    # True: `_post` checks every range of its part itself (positive lengths, addresses inside the regions) in
    # the passes it makes anyway, so `_transfer` skips DescriptorList.validate's two passes per list
    checks_ranges: ClassVar[bool] = False

    def __init__(self, name: str) -> None:
        if not name or not isinstance(name, str):
            raise AgentError("an agent needs a non-empty name, unique among its peers")
        self.name = name
        self._kvb_regions = RegionTable()
        self._kvb_next_key = 0
        self._kvb_peers: set[str] = set()
        self._kvb_closed = False
        self._kvb_lock = threading.RLock()

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
        with self._kvb_lock:
            key = self._kvb_next_key
            self._kvb_next_key += 1
            self._register(region, key)
            self._kvb_regions.add(key, region)
        return Registration(self, region, key, self._deregister)

    def deregister_memory(self, registration: Registration) -> None:
        """Deregister a region (same as `registration.release()`)."""
        registration.release()

    def _deregister(self, registration: Registration) -> None:
        with self._kvb_lock:
            if self._kvb_regions.remove(registration.key) is not None and not self._kvb_closed:
                self._unregister(registration.region, registration.key)

    def registered_regions(self) -> list[MemoryRegion]:
        return self._kvb_regions.regions()

    def check_registered(self, descs: DescriptorList, what: str) -> None:
        """Raise RegistrationError (naming `what` and the first bad descriptor) unless every range in `descs`
        lies inside one region registered with this agent, of the same memory kind and device.

        For serving sides that act on ranges a peer named (a two-sided transport's server thread)."""
        self._kvb_regions.check(descs, what)

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
        with self._kvb_lock:
            self._kvb_peers.add(peer)
        return peer

    def disconnect(self, peer: str) -> None:
        """Forget a peer; later transfers naming it raise PeerError. Unknown peers are ignored."""
        with self._kvb_lock:
            known = peer in self._kvb_peers
            self._kvb_peers.discard(peer)
        if known and not self._kvb_closed:
            self._disconnect(peer)

    @property
    def peers(self) -> frozenset[str]:
        return frozenset(self._kvb_peers)

    # --- transfers ------------------------------------------------------------------------------------
    def read(self, peer: str, local: DescriptorList, remote: DescriptorList) -> TransferHandle:
        """Post a one-sided READ: remote[i] -> local[i] for every i. Returns at once with a handle."""
        return self._transfer("READ", peer, local, remote)

    def write(self, peer: str, local: DescriptorList, remote: DescriptorList) -> TransferHandle:
        """Post a one-sided WRITE: local[i] -> remote[i] for every i. Returns at once with a handle."""
        return self._transfer("WRITE", peer, local, remote)

    def read_grid(self, peer: str, local: DescriptorGrid, remote: DescriptorGrid) -> TransferHandle:
        """`read` for ranges given as DescriptorGrids (remote range i -> local range i, for every i).

        An agent that sets `grid_native` checks and stages the grids without listing their ranges; any other
        gets them as DescriptorLists. The local side is checked here: its span inside one registered region,
        or else range by range.
        """
        self._check_open()
        if peer not in self._kvb_peers:
            raise PeerError(f"READ names peer {peer!r}, which this agent is not connected to")
        if (local.outer.size, local.inner.size, local.length) != (remote.outer.size, remote.inner.size,
                                                                   remote.length):
            raise AgentError(f"READ: local grid {local.outer.size} x {local.inner.size} of {local.length} bytes, "
                             f"remote grid {remote.outer.size} x {remote.inner.size} of {remote.length} bytes")
        for d, side in ((local, "local"), (remote, "remote")):
            if d.kind not in self.memory_kinds:
                raise AgentError(f"READ: {self.agent_kind} agent cannot move {side} {d.kind.value} memory")
        if not self.grid_native:
            return self._transfer("READ", peer, local.to_list(), remote.to_list())
        if not len(local):
            return self._post_grid("READ", peer, local, remote)
        lo, hi = local.bounds()
        if not self._kvb_regions.contains_span(local.kind, local.device, lo, hi + local.length):
            self._kvb_regions.check(local.to_list(), "READ local side")  # names the first bad range
        r = local.inner.size
        rows = max(1, self.post_chunk // r) if self.post_chunk else local.outer.size
        if local.outer.size <= rows:
            return self._post_grid("READ", peer, local, remote)
        parts: list[TransferHandle] = []  # pipelined by rows, as `_transfer` does by descriptors
        a = 0
        try:
            for b in self._part_ends(local.outer.size, rows, local.length):
                parts.append(self._post_grid("READ", peer, local.rows(a, b), remote.rows(a, b)))
                a = b
        except BaseException:
            settle_all(parts)
            raise
        return self._joined(parts)

    def _transfer(self, op: str, peer: str, local: DescriptorList, remote: DescriptorList) -> TransferHandle:
        self._check_open()
        if peer not in self._kvb_peers:
            raise PeerError(f"{op} names peer {peer!r}, which this agent is not connected to")
        if len(local) != len(remote):
            raise AgentError(f"{op}: {len(local)} local descriptors but {len(remote)} remote ones")
        if not self.checks_ranges:  # the agent gets checked lists; else it checks each part as it stages it
            local.validate()
            remote.validate()
        llen, rlen = local.raw()[1], remote.raw()[1]
        if not _same_array(llen, rlen) and not np.array_equal(llen, rlen):
            bad = int(np.argmax(llen != rlen))
            raise AgentError(f"{op}: descriptor {bad} is {llen[bad]} bytes locally but {rlen[bad]} remotely")
        for d, side in ((local, "local"), (remote, "remote")):
            if d.kind not in self.memory_kinds:
                raise AgentError(f"{op}: {self.agent_kind} agent cannot move {side} {d.kind.value} memory")
        n = len(local)
        if self._posted_whole(n):
            self._kvb_regions.check(local, f"{op} local side")
            return self._post(op, peer, local, remote)
        # Pipelined posting: check and post the list chunk by chunk, so the host work on chunk i+1 overlaps
        # the transfer of chunk i. The first chunk is small so data starts moving at once.
        head = llen[:max(1, self.post_chunk // 8)]  # the first part's fragments: their mean size
        parts: list[TransferHandle] = []
        a = 0
        try:
            for b in self._part_ends(n, self.post_chunk, int(head.sum()) // head.size):
                lo, ro = local[a:b], remote[a:b]
                self._kvb_regions.check(lo, f"{op} local side (descriptors {a}..{b - 1})")
                parts.append(self._post(op, peer, lo, ro))
                a = b
        except BaseException:
            settle_all(parts)  # nothing may still be moving when the caller sees the error
            raise
        return self._joined(parts)

    def _posted_whole(self, n: int) -> bool:
        """Whether a list of `n` descriptors goes out as one post (else as chunks of at most `post_chunk`)."""
        return not self.post_chunk or n <= self.post_chunk

    def _part_ends(self, n: int, chunk: int, frag: int) -> list[int]:
        """End offsets of the pipelined parts of `n` descriptors (or grid rows) of at most `chunk`, the first
        fragments `frag` bytes on average: `chunk_bounds`, growing if `post_grow`."""
        return chunk_bounds(n, chunk, bool(self.post_grow))

    def _joined(self, parts: list[TransferHandle]) -> TransferHandle:
        """The handle of one transfer posted as pipelined parts (an agent whose parts end in order may poll
        them more cheaply)."""
        return ChunkedTransfer(parts)

    # --- teardown -------------------------------------------------------------------------------------
    def close(self) -> None:
        """Release the agent's transport resources. Registrations and peers are dropped."""
        if self._kvb_closed:
            return
        with self._kvb_lock:
            self._kvb_closed = True
            self._close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._kvb_closed:
            raise AgentError(f"{self.agent_kind} agent {self.name!r} is closed")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.name!r}, peers={len(self._kvb_peers)}, "
                f"regions={len(self._kvb_regions)})")

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
        """Post the (already validated) transfer; never block on data movement.

        `op` is "READ" (remote[i] -> local[i]) or "WRITE" (local[i] -> remote[i]); nothing else."""

    def _post_grid(self, op: str, peer: str, local: DescriptorGrid, remote: DescriptorGrid) -> TransferHandle:
        """Post a transfer of grids (`grid_native` agents; the local span is checked, the remote one is not)."""
        raise NotImplementedError(f"{type(self).__name__} sets grid_native but has no _post_grid")

    def _close(self) -> None:
        """Release transport resources (optional)."""
