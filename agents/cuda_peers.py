"""The cuda_ipc agent's view of its peers: what each advertised, opened once per local device, and a region
table whose check first tries "everything inside one region" (the common case of one pool) before the
per-descriptor search.

Owns opening and closing peers' IPC handles (through cuda_driver's process-wide cache) and validating the
regions a peer advertises (bytes from the network: strict types and bounds, PeerError naming what was wrong).
Never maps memory it did not bounds-check against the allocation it opened.
"""

from __future__ import annotations

import threading

import numpy as np

from ..errors import AgentError, PeerError, RegistrationError
from . import cuda_driver as drv
from .base import DescriptorList, MemoryKind, MemoryRegion, RegionTable

MAX_REGIONS = 1 << 16


class _Peer:
    """A connected peer: its advertised regions and, per local device, their addresses in this process."""

    def __init__(self, name: str, regions: list[tuple], same_process: bool) -> None:
        self.name = name
        self.regions = regions  # (addr, length, device, pci, handle, offset)
        self.same_process = same_process
        self.table = FastRegionTable()
        for i, (addr, length, device, *_rest) in enumerate(regions):
            self.table.add(i, MemoryRegion(addr, length, MemoryKind.VRAM, device))
        self._maps: dict[int, dict[int, tuple[np.ndarray, np.ndarray]]] = {}  # local dev -> peer dev -> map
        self._opened: list[tuple[bytes, drv.Device]] = []
        self._ordinals: dict[int, int] = {}  # the peer's device number -> this process's ordinal of that GPU
        self._lock = threading.Lock()

    def ensure(self, local: drv.Device) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Open (once) every advertised region for kernels on `local`; PeerError if one cannot be."""
        with self._lock:
            per_dev = self._maps.get(local.ordinal)
            if per_dev is None:
                per_dev = self._maps[local.ordinal] = self._open(local)
            return per_dev

    def ordinal_of(self, device: int) -> int:
        """This process's ordinal of the GPU the peer calls `device` (by the PCI bus id it advertised)."""
        hit = self._ordinals.get(device)
        if hit is None:
            pci = next((r[3] for r in self.regions if r[2] == device), None)
            hit = None if pci is None else drv.ordinal_by_pci(pci)
            if hit is None:
                raise PeerError(f"peer {self.name!r} has no memory this process can see on its device {device} "
                                f"(PCI bus id {pci or 'not advertised'}; check CUDA_VISIBLE_DEVICES)")
            self._ordinals[device] = hit
        return hit

    def mapping(self, local: drv.Device, peer_device: int) -> tuple[np.ndarray, np.ndarray]:
        """(sorted region starts, delta to add for this process's address) for regions on `peer_device`."""
        hit = self.ensure(local).get(peer_device)
        if hit is None:
            raise RegistrationError(f"peer {self.name!r} advertised no VRAM on its device {peer_device}")
        return hit

    def _open(self, local: drv.Device) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        rows: dict[int, list[tuple[int, int]]] = {}
        for addr, length, device, pci, handle, offset in self.regions:
            remote = drv.ordinal_by_pci(pci)
            if remote is None:
                raise PeerError(f"peer {self.name!r} has memory on GPU {pci}, which this process cannot see "
                                "(check CUDA_VISIBLE_DEVICES)")
            if not local.can_access_peer(remote):
                raise PeerError(f"GPU {local.pci_bus_id} (device {local.ordinal}) has no peer-to-peer path "
                                f"to peer {self.name!r}'s GPU {pci}; use the 'nixl' agent for this pair")
            if self.same_process:  # both contexts live here already: enable access explicitly
                local.enable_peer_access(drv.Device.get(remote))
                va = addr
            else:  # imported with CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: no context on the peer's GPU needed
                try:
                    base = drv.IpcMappings.acquire(handle, local)
                except AgentError as e:
                    raise PeerError(f"could not open peer {self.name!r}'s CUDA IPC handle for {length} bytes "
                                    f"at {addr:#x} (was the memory freed?): {e}") from None
                self._opened.append((handle, local))
                _, size = drv.allocation_of(base, local)
                if offset + length > size:
                    raise PeerError(f"peer {self.name!r} advertises {length} bytes at offset {offset} of an "
                                    f"allocation of only {size} bytes")
                va = base + offset
            rows.setdefault(device, []).append((addr, va - addr))
        out = {}
        for device, pairs in rows.items():
            pairs.sort()
            out[device] = (np.array([a for a, _ in pairs], dtype=np.int64),
                           np.array([d for _, d in pairs], dtype=np.int64))
        return out

    def close(self) -> None:
        with self._lock:
            opened, self._opened, self._maps = self._opened, [], {}
        for handle, dev in opened:
            drv.IpcMappings.release(handle, dev)


class FastRegionTable(RegionTable):
    """RegionTable whose check first tries "all descriptors inside one region" with four reductions.

    Same answers as RegionTable.check, also for a DescriptorList not yet validated (its quick test requires
    every length positive and the lowest address inside a region, which implies every address positive);
    falls back to RegionTable.check (per-descriptor search, which validates the list first) when it fails.
    """

    _last: tuple = (None, 0, 0)  # (lengths array, its min, its max) from the latest check: read() reuses them

    def check(self, descs: DescriptorList, what: str, lengths: tuple[int, int] | None = None) -> None:
        """RegionTable.check; `lengths` ((min, max) of descs' lengths, if the caller has them) saves passes."""
        if len(descs):
            starts, ends = self._sorted(descs.kind, descs.device)
            if starts.size:
                addrs, lens = descs.raw()
                lo = int(addrs.min())
                i = int(starts.searchsorted(lo, "right")) - 1
                bot, top = (int(lens.min()), int(lens.max())) if lengths is None else lengths
                self._last = (lens, bot, top)
                if i >= 0 and bot > 0 and int(addrs.max()) + top <= int(ends[i]):
                    return
        super().check(descs, what)

    def length_range(self, lengths: np.ndarray) -> tuple[int, int]:
        """(lengths.min(), lengths.max()), from the latest check when it saw this very array (two passes fewer
        per READ)."""
        arr, bot, top = self._last
        return (bot, top) if arr is lengths else (int(lengths.min()), int(lengths.max()))


def _parse_regions(name: str, raw) -> list[tuple]:
    if not isinstance(raw, list) or len(raw) > MAX_REGIONS:
        raise PeerError(f"peer {name!r} metadata: 'regions' must be a list of at most {MAX_REGIONS} entries")
    out = []
    for i, r in enumerate(raw):
        ok = isinstance(r, list) and len(r) == 6
        if ok:
            addr, length, device, pci, handle, offset = r
            ok = (all(isinstance(v, int) and not isinstance(v, bool) for v in (addr, length, device, offset))
                  and addr > 0 and length > 0 and 0 <= device < 1024 and 0 <= offset < (1 << 62)
                  and addr + length < (1 << 63) and isinstance(pci, str) and 0 < len(pci) <= 32
                  and isinstance(handle, bytes) and len(handle) == 64)
        if not ok:
            raise PeerError(f"peer {name!r} metadata: region {i} is not [addr>0, length>0, device, "
                            f"pci bus id, 64-byte IPC handle, offset>=0]: {str(r)[:200]}")
        out.append((addr, length, device, pci, handle, offset))
    return out
