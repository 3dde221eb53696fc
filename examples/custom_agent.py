"""A complete custom TransferAgent in one page: Linux cross-memory attach (process_vm_readv/writev).

It reads and writes another process's registered host memory directly, one-sided, with no daemon and no
library: the same kernel mechanism UCX's `cma` transport uses. Everything it needs comes from
`kvbridge.agents`. It passes kvbridge's agent conformance suite like the built-in agents; from a checkout's
root:

    kvbridge check-agent examples.custom_agent:CmaAgent

Use it by name after registering it:

    from kvbridge.agents import register_agent, create_agent
    from examples.custom_agent import CmaAgent
    register_agent("cma", CmaAgent)
    agent = create_agent("cma", "ctx-rank0")

or, from your own package, with an entry point in its pyproject.toml:

    [project.entry-points."kvbridge.agents"]
    cma = "my_package.cma:CmaAgent"

Limits: Linux only, host memory only, both processes of one host and user (ptrace rules apply).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvbridge.agents import (DescriptorList, FutureTransfer, MemoryKind, MemoryRegion, PeerError, RegionTable,
                             TransferAgent, TransferHandle, field, open_envelope, seal)

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
for _fn in (_libc.process_vm_readv, _libc.process_vm_writev):
    _fn.restype = ctypes.c_ssize_t
    _fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                    ctypes.c_ulong]
_IOV_MAX = 1024


class CmaAgent(TransferAgent):
    """One-sided host-memory transfers between processes of one host via process_vm_readv/writev."""

    agent_kind = "cma"
    memory_kinds = frozenset({MemoryKind.DRAM})

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._remote: dict[str, tuple[int, RegionTable]] = {}
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"cma-{name}")
        self._mu = threading.Lock()

    def _register(self, region: MemoryRegion, key: int) -> None:
        pass  # nothing to pin: the kernel reads the pages when asked

    def _unregister(self, region: MemoryRegion, key: int) -> None:
        pass

    def _metadata(self) -> bytes:
        regions = [[r.addr, r.length] for r in self.registered_regions()]
        return seal(self.agent_kind, self.name, {"pid": os.getpid(), "regions": regions})

    def _connect(self, peer_metadata: bytes) -> str:
        name, payload = open_envelope(peer_metadata, self.agent_kind)
        pid = field(payload, "pid", int)
        table = RegionTable()
        for i, r in enumerate(field(payload, "regions", list)):
            if not (isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) for x in r)):
                raise PeerError(f"peer metadata: region {i} is not [addr, length]")
            table.add(i, MemoryRegion(r[0], r[1]))
        with self._mu:
            self._remote[name] = (pid, table)
        return name

    def _disconnect(self, peer: str) -> None:
        with self._mu:
            self._remote.pop(peer, None)

    def _post(self, op: str, peer: str, local: DescriptorList, remote: DescriptorList) -> TransferHandle:
        with self._mu:
            entry = self._remote.get(peer)
        if entry is None:  # disconnected by another thread since the base class checked
            raise PeerError(f"{op} names peer {peer!r}, which was disconnected")
        pid, table = entry
        table.check(remote, f"{op} remote side (peer {peer!r})")
        fn = _libc.process_vm_readv if op == "READ" else _libc.process_vm_writev
        fut = self._pool.submit(_move, fn, pid, local, remote)
        return FutureTransfer(fut, len(local), local.nbytes)  # state/wait/cancel from the pool's future

    def _close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _move(fn, pid: int, local: DescriptorList, remote: DescriptorList) -> None:
    liov = np.stack([local.addrs, local.lengths], axis=1).astype(np.uint64)
    riov = np.stack([remote.addrs, remote.lengths], axis=1).astype(np.uint64)
    for s in range(0, len(local), _IOV_MAX):
        lo, ro = liov[s:s + _IOV_MAX], riov[s:s + _IOV_MAX]
        want = int(lo[:, 1].sum())
        got = fn(pid, lo.ctypes.data, len(lo), ro.ctypes.data, len(ro), 0)
        if got != want:
            err = ctypes.get_errno()
            raise OSError(err, f"moved {got} of {want} bytes from/to pid {pid}: {os.strerror(err)}")
