"""CudaIpcAgent: one-sided READ/WRITE between GPUs of one host, one kernel launch per transfer.

The exporting side advertises, for each registered VRAM region, the CUDA IPC handle of the allocation that
holds it (caching allocators hand out sub-ranges of larger cudaMalloc blocks, so the handle is the base
allocation's, plus the region's offset inside it), its size and device (PCI bus id), and the host's
identity (hostname + boot id). A peer's `connect()` checks that it runs on the same host, opens each handle
once (process-wide cache), checks that the advertised region fits the allocation it opened, and enables
peer access. A READ or WRITE then bounds-checks every remote descriptor against the peer's advertised
regions (RegionTable), translates it to this process's mapping, stages src/dst/prefix-sum arrays in pinned
memory, uploads them with one H2D copy (on a side stream, so it overlaps the copy before it) and launches ONE
kernel (`cuda_kernels`) on a dedicated non-blocking stream of the local device (`cuda_engine`), waiting for
that upload only, followed by a CUDA event that `state()` queries. With `launch_on="peer"` the stream, the kernel
and the peer's mappings are those of the peer's GPU (opened in this process), given access to the local one.
Handles: `cuda_handles`.

Never does: a blocking synchronize (every wait polls the event against a deadline), a transfer to or from
a descriptor it has not bounds-checked, or unmapping peer memory / freeing staging buffers while a kernel
that uses them may still run (releases are deferred behind an event on the stream).

Ordering: like NIXL, a transfer reads the bytes as they are when its kernel runs; the caller makes sure the
producer finished (e.g. synchronises its compute stream) before posting. Cancelling cannot stop a launched
kernel: the handle stays PENDING until the kernel ends, then reports FAILED ("cancelled").
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from ..errors import AgentError, PeerError, RegistrationError
from . import cuda_driver as drv
from .base import DescriptorGrid, DescriptorList, MemoryKind, MemoryRegion, TransferAgent, TransferHandle
from .handles import chunk_bounds
from .cuda_engine import Engine, Slot
from .cuda_handles import CudaIpcChunked, CudaIpcTransfer, _await_end  # noqa: F401 - re-exported
from .cuda_peers import MAX_REGIONS, FastRegionTable, _parse_regions, _Peer  # noqa: F401 - re-exported
from .cuda_kernels import CopyKernel, CopyTuning
from .envelope import field, open_envelope, seal

log = logging.getLogger(__name__)

_GROW_BELOW = 16384  # post_grow=None: parts grow where the first fragments average fewer bytes than this


class CudaIpcAgent(TransferAgent):
    """TransferAgent over CUDA IPC + one SM copy kernel per transfer (GPUs of one host, VRAM only).

    Args:
        name: unique among the peers this agent talks to.
        chunk: bytes per warp work item (None: chosen per transfer); for tuning and tests.
        max_blocks: cap on CTAs per launch (None: full occupancy); for tuning and tests.
        kernel: the copy kernel variant (CopyKernel.ANY; ALIGNED only where every fragment is 16-byte
            aligned on both ends, as in benchmarks).
        timing: time each transfer on the GPU (descriptor upload + kernel) into `handle.gpu_seconds`.
        post_chunk: descriptors per pipelined kernel (None: the class default); for tuning and tests.
        side_upload: upload descriptor tables on a second stream, so the next transfer's upload overlaps the
            current copy (False: on the kernel's stream, ahead of its kernel, as before).
        post_grow: True: pipelined parts double from post_chunk / 8 up to post_chunk; False: a first part of
            post_chunk / 8, then post_chunk each (as before); None (default): True where the first part's
            fragments average under 16 KiB (`_GROW_BELOW`), else False.
        grid_kernel: a grid READ uploads its outer and inner arrays and the grid kernel forms the addresses
            (None: the class default, True); False: every address staged on the host, as before.
        launch_on: which GPU runs the copy kernel: "local" (default: the GPU of this side's memory) or "peer"
            (the GPU of the peer's memory: a READ loads there and stores across the link). Two readers that
            share one GPU and read from another set one of them to "peer": their kernels then run on two GPUs
            at once instead of taking turns on the shared one (`docs/limits.md`). Costs a CUDA context and the
            kernel on the peer's GPU in this process.
    Raises:
        AgentError: if CUDA Python bindings, an NVIDIA driver or a GPU is missing, or a knob is out of range.

    `tuning` (a CopyTuning of kernel, chunk, max_blocks) may be replaced between transfers (a benchmark sweeping
    launch geometries on one connected agent); a transfer uses the tuning current at its post.
    """

    agent_kind = "cuda_ipc"
    memory_kinds = frozenset({MemoryKind.VRAM})
    # Long lists go out as pipelined kernels of at most this many fragments: checking and staging the next
    # chunk on the host overlaps the copy of the current one (a single READ of 262k 4 KiB fragments otherwise
    # pays ~1.9 ms of host work before the first byte moves). Lists over twice the first chunk (post_chunk / 8)
    # are pipelined (`_posted_whole`).
    post_chunk = 32768
    # Small fragments: the parts double from post_chunk / 8 (4,096, 8,192, 16,384, 32,768, ...), so each part's
    # host work (~50 us of driver calls + ~4-6 ns per descriptor) fits under the copy of the part before (equal
    # parts left a 133 us hole after the first 4 KiB kernel). From 16 KiB the first kernel already covers the
    # second part's host work on a fast host, and the extra parts' kernel boundaries cost ~10 us per READ
    # (bench/RESULTS.md, "Parts that grow"): equal parts there. None: that choice; True / False: always.
    post_grow: bool | None = None

    def __init__(self, name: str, *, chunk: int | None = None, max_blocks: int | None = None,
                 kernel: CopyKernel = CopyKernel.ANY, timing: bool = False, post_chunk: int | None = None,
                 side_upload: bool = True, post_grow: bool | None = None, grid_kernel: bool | None = None,
                 launch_on: str = "local") -> None:
        tuning = CopyTuning(kernel, chunk, max_blocks)  # checked before anything is loaded
        if launch_on not in ("local", "peer"):
            raise AgentError(f"launch_on must be 'local' or 'peer', got {launch_on!r}")
        self._launch_on = launch_on
        if post_chunk is not None:
            if isinstance(post_chunk, bool) or not isinstance(post_chunk, int) or post_chunk < 1:
                raise AgentError(f"post_chunk must be a positive number of descriptors, got {post_chunk!r}")
            self.post_chunk = post_chunk
        for knob, value in (("post_grow", post_grow), ("grid_kernel", grid_kernel)):
            if value is not None:
                if not isinstance(value, bool):
                    raise AgentError(f"{knob} must be True, False or None, got {value!r}")
                setattr(self, knob, value)
        if not isinstance(side_upload, bool):
            raise AgentError(f"side_upload must be True or False, got {side_upload!r}")
        self._side_upload = side_upload
        super().__init__(name)
        self._kvb_regions = FastRegionTable()  # the base class's table, same checks, faster for one pool
        drv.load()
        if drv.device_count() < 1:
            raise AgentError("the cuda_ipc agent needs a CUDA GPU; the driver reports none visible")
        self._tuning, self._timing = tuning, timing
        self._host = drv.host_identity()
        self._exports: dict[int, tuple] = {}
        self._remote: dict[str, _Peer] = {}
        self._engines: dict[int, Engine] = {}
        self._ipc_lock = threading.RLock()  # this agent's own tables (the base class keeps its lock to itself)

    @property
    def tuning(self) -> CopyTuning:
        """The copy kernel's launch knobs used by the next transfer posted."""
        return self._tuning

    @tuning.setter
    def tuning(self, value: CopyTuning) -> None:
        if not isinstance(value, CopyTuning):
            raise AgentError(f"tuning must be a CopyTuning, got {type(value).__name__}")
        self._tuning = value

    # --- memory ---------------------------------------------------------------------------------------
    def _register(self, region: MemoryRegion, key: int) -> None:
        dev = drv.Device.get(region.device)
        try:
            base, size = drv.allocation_of(region.addr, dev)
        except AgentError as e:
            raise RegistrationError(f"{region} is not device memory of CUDA device {region.device}: "
                                    f"{e}") from None
        if region.addr + region.length > base + size:
            raise RegistrationError(f"{region} runs past the end of its CUDA allocation ({size} bytes at "
                                    f"{base:#x}); register each allocation separately")
        try:
            handle = drv.export_handle(base, dev)
        except AgentError as e:
            raise RegistrationError(f"cannot export {region} over CUDA IPC (memory from cuMemCreate, e.g. "
                                    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, cannot be): "
                                    f"{e}") from None
        self._exports[key] = [region.addr, region.length, region.device, dev.pci_bus_id, handle,
                              region.addr - base]

    def _unregister(self, region: MemoryRegion, key: int) -> None:
        self._exports.pop(key, None)

    # --- peers ----------------------------------------------------------------------------------------
    def _metadata(self) -> bytes:
        host, boot = self._host
        return seal(self.agent_kind, self.name, {"host": host, "boot": boot, "proc": drv.PROCESS_TOKEN,
                                                 "regions": list(self._exports.values())})

    def _connect(self, peer_metadata: bytes) -> str:
        name, payload = open_envelope(peer_metadata, self.agent_kind)
        if name == self.name:
            raise PeerError(f"peer metadata carries this agent's own name {name!r}; names must be unique")
        host, boot = field(payload, "host", str), field(payload, "boot", str)
        proc = field(payload, "proc", str)
        if (host, boot) != self._host:
            raise PeerError(f"peer {name!r} runs on host {host!r} (boot id {boot or '?'}), this agent on "
                            f"{self._host[0]!r} (boot id {self._host[1] or '?'}): CUDA IPC reaches only GPUs "
                            "of the same host; use the 'nixl' agent across hosts")
        peer = _Peer(name, _parse_regions(name, payload.get("regions")), proc == drv.PROCESS_TOKEN)
        try:  # open the handles and build the kernel now, not on the first transfer
            remotes = sorted({r[2] for r in peer.regions}) if self._launch_on == "peer" else [None]
            for dev in sorted({r.device for r in self.registered_regions()}):
                for remote in remotes:
                    peer.ensure(self._kernel_engine(peer, dev, remote).dev)
        except Exception:
            peer.close()
            raise
        with self._ipc_lock:
            old = self._remote.get(name)
            self._remote[name] = peer
        if old is not None:
            self._retire(old)
        return name

    def _disconnect(self, peer: str) -> None:
        with self._ipc_lock:
            old = self._remote.pop(peer, None)
        if old is not None:
            self._retire(old)

    def _retire(self, peer: _Peer) -> None:
        """Unmap a peer's memory once every kernel already enqueued has finished."""
        engines = list(self._engines.values())
        if not engines:
            peer.close()
            return
        remaining = [len(engines)]
        lock = threading.Lock()

        def one_done() -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                peer.close()

        for e in engines:
            e.defer(one_done)

    # --- transfers ------------------------------------------------------------------------------------
    def _engine(self, device: int) -> Engine:
        with self._ipc_lock:
            e = self._engines.get(device)
            if e is None:
                e = self._engines[device] = Engine(drv.Device.get(device), self._timing, self._side_upload)
            return e

    def _kernel_engine(self, p: _Peer, local_device: int, remote_device: int | None) -> Engine:
        """The engine whose GPU runs a transfer's kernel (`launch_on`): the local device's, or the one of the peer's
        `remote_device`, given access to ours (`remote_device` is unused, and may be None, for "local")."""
        if self._launch_on == "local":
            return self._engine(local_device)
        engine = self._engine(p.ordinal_of(remote_device))
        engine.dev.enable_peer_access(drv.Device.get(local_device))
        return engine

    grid_native = True  # grids are bounds-checked from their extremes and written straight into staging
    grid_kernel: bool = True  # grid READs upload outer + inner (k + r words a side); the grid kernel adds them
    checks_ranges = True  # each part's ranges are checked in the passes its staging makes anyway (`_post`)

    def _post(self, op: str, peer: str, local: DescriptorList, remote: DescriptorList) -> TransferHandle:
        n = len(local)
        if n == 0:
            return CudaIpcTransfer(None, None, 0, 0)
        p = self._peer(op, peer)
        # checks_ranges: the base class's check of this part (FastRegionTable) covered the local side
        local_addrs, lens = local.raw()  # lens == remote's (the base class checked)
        lmin, lmax = self._kvb_regions.length_range(lens)  # the base class's local check just computed them
        if lmin <= 0:
            local.validate()  # names the descriptor
        p.table.check(remote, f"{op} remote side (peer {peer!r})", (lmin, lmax))
        remote_addrs = remote.raw()[0]
        engine = self._kernel_engine(p, local.device, remote.device)
        starts, deltas = p.mapping(engine.dev, remote.device)
        flen = lmax if lmin == lmax else 0  # equal lengths: no prefix sum, no search
        words = 2 * n if flen else 3 * n + 1
        slot = engine.acquire(words)
        try:
            w = slot.pinned.words  # table: src[n] | dst[n] | cum[n + 1] (no cum when lengths are equal)
            remote_va, local_va = (w[:n], w[n:2 * n]) if op == "READ" else (w[n:2 * n], w[:n])
            if starts.size == 1 or not deltas.any():  # one mapping (or this process's own addresses)
                np.add(remote_addrs, deltas[0], out=remote_va)
            else:
                idx = np.searchsorted(starts, remote_addrs, side="right") - 1
                np.add(remote_addrs, deltas[idx], out=remote_va)
            local_va[:] = local_addrs
            if flen:
                total = flen * n
            else:
                w[2 * n] = 0
                np.cumsum(lens, out=w[2 * n + 1:3 * n + 1])
                total = int(w[3 * n])
        except Exception:
            engine.recycle(slot, done=False)
            raise
        return self._launch(engine, slot, n, total, flen, words)

    def _post_grid(self, op: str, peer: str, local: DescriptorGrid, remote: DescriptorGrid) -> TransferHandle:
        """A READ of grids: the remote span checked against the peer's regions in one test (range by range
        only when it fails), the grid's arrays (or, without grid_kernel, every address) into the pinned table,
        one upload, one kernel."""
        n = len(local)
        if n == 0:
            return CudaIpcTransfer(None, None, 0, 0)
        p = self._peer(op, peer)
        lo, hi = remote.bounds()
        engine = self._kernel_engine(p, local.device, remote.device)
        starts, deltas = p.mapping(engine.dev, remote.device)
        inside = p.table.contains_span(remote.kind, remote.device, lo, hi + remote.length)
        if op != "READ" or not inside or (starts.size > 1 and deltas.any()):  # the list path, range by range
            return self._post(op, peer, local.to_list(), remote.to_list())
        # table: src_outer | src_inner | dst_outer | dst_inner (grid kernel), else src[n] | dst[n]
        rows = local.inner.size if self.grid_kernel else 0  # read once: the table and the kernel agree
        half = local.outer.size + rows if rows else n
        slot = engine.acquire(2 * half)
        try:
            w = slot.pinned.words
            for g, out, delta in ((remote, w[:half], int(deltas[0])), (local, w[half:2 * half], 0)):
                (g.write_axes if rows else g.write)(out, delta)
        except Exception:
            engine.recycle(slot, done=False)
            raise
        return self._launch(engine, slot, n, n * local.length, local.length, 2 * half, grid=rows)

    def _joined(self, parts: list[TransferHandle]) -> TransferHandle:
        return CudaIpcChunked(parts)

    def _posted_whole(self, n: int) -> bool:
        # Pipelined from twice the first chunk on: the first kernel starts after the host work of post_chunk / 8
        # descriptors instead of all n (a READ of 16,384 x 64 KiB: 4,096, then 12,288 while the first copies).
        return n <= 2 * max(1, self.post_chunk // 8)

    def _part_ends(self, n: int, chunk: int, frag: int) -> list[int]:
        grow = self.post_grow if self.post_grow is not None else frag < _GROW_BELOW
        return chunk_bounds(n, chunk, grow)

    def _peer(self, op: str, peer: str) -> _Peer:
        p = self._remote.get(peer)
        if p is None:
            raise PeerError(f"{op} names peer {peer!r}, which this agent is not connected to")
        return p

    def _launch(self, engine: Engine, slot: Slot, n: int, total: int, flen: int, words: int,
                grid: int = 0) -> TransferHandle:
        """Upload a staged table (side stream: the kernel waits for this upload only) and launch its kernel
        (the grid kernel, rows of `grid` fragments, where `grid` > 0)."""
        side = engine.upload  # None: the table goes up on the kernel's own stream
        enqueued = None  # the stream an upload was enqueued on: a failure fences the slot behind it
        cu, _ = drv.load()
        try:
            tuning = self._tuning  # one read: a concurrent `tuning = ...` changes the next transfer only
            aligned = tuning.kernel is CopyKernel.ALIGNED
            with engine.dev.current():
                if side is not None and engine.idle():  # no copy running to overlap: no cross-stream wait
                    side = None
                up = side if side is not None else engine.stream
                if slot.start is not None:
                    drv.check(cu.cuEventRecord(slot.start, up), "cuEventRecord")
                drv.check(cu.cuMemcpyHtoDAsync(slot.table.ptr, slot.pinned.ptr, words * 8, up),
                          "cuMemcpyHtoDAsync (descriptor table)")
                enqueued = up
                if side is not None:
                    drv.check(cu.cuEventRecord(slot.uploaded, side), "cuEventRecord")
                    drv.check(cu.cuStreamWaitEvent(engine.stream, slot.uploaded, 0), "cuStreamWaitEvent")
                    enqueued = engine.stream
                engine.copier.launch(slot.table.ptr, n, total, aligned, engine.stream, uniform=flen,
                                     chunk=tuning.chunk, max_blocks=tuning.max_blocks, args=slot.args,
                                     current=True, grid=grid)
                drv.check(cu.cuEventRecord(slot.event, engine.stream), "cuEventRecord")
                engine.tail = slot
        except Exception:
            if enqueued is not None:  # the slot is reused only once what was enqueued with it has run
                with engine.dev.current():
                    cu.cuEventRecord(slot.event, enqueued)
            engine.recycle(slot, done=False)
            raise
        return CudaIpcTransfer(engine, slot, n, total)

    def _close(self) -> None:
        peers, self._remote = list(self._remote.values()), {}
        engines, self._engines = list(self._engines.values()), {}
        drained = all([e.drain(10.0) for e in engines])
        if drained:
            for p in peers:
                p.close()
        self._exports.clear()
