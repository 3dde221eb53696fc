"""A stand-in for NVIDIA's `cuda.bindings` (driver + nvrtc) on a machine without a GPU: for measuring the
cuda_ipc agent's host work and for CPU tests of what it hands the GPU. Never used by the library itself.

What it pretends: two devices (ordinals 0 and 1, sm_90, 132 SMs, peer access both ways), one process (IPC
handles name allocations of this process only). "Device memory" is either host memory the stub allocated
(`device_buffer`, real bytes) or an address range with nothing behind it (`device_range`, for timing only:
never copy into it). A host-to-device copy is a memmove done at once; every event is complete when recorded;
a kernel launch is recorded (`launches`: the kernel's arguments, its descriptor table and a host timestamp)
and, with `run_kernels = True`, performs the copy the fragment kernel would, byte for byte, synchronously. So
stream order is program order, which is one valid order of what the agent enqueues. `calls` counts the driver
calls by name (the host work of a post is mostly numpy passes and these calls).

    from kvbridge.bench import cuda_stub
    with cuda_stub.installed() as stub:
        agent = create_agent("cuda_ipc", "a")       # its cuda_driver now talks to the stub
        buf = stub.device_buffer(1 << 20, device=1)  # numpy uint8 array standing for VRAM of device 1
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import enum
import sys
import time
import types

import numpy as np

__all__ = ["Stub", "installed"]

_RANGE_BASE = 0x6000_0000_0000  # `device_range` addresses start here (never dereferenced)


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_NOT_READY = 600
    CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704


class _Handle:
    """An opaque driver object (context, stream, event, module, function)."""

    def __init__(self, kind: str, **kw) -> None:
        self.kind = kind
        self.__dict__.update(kw)


class CUipcMemHandle:
    def __init__(self) -> None:
        self.reserved = bytes(64)


class Launch:
    """One recorded kernel launch: its name, grid, the kernel arguments (five; six for the grid kernels, whose
    table is src_outer | src_inner | dst_outer | dst_inner), a copy of its table, when."""

    def __init__(self, name: bytes, grid: int, args: tuple[int, ...], table: np.ndarray, at: float) -> None:
        self.name, self.grid, self.args, self.table, self.at = name, grid, args, table, at
        self.device: int | None = None  # the device of the context current at the launch

    @property
    def n(self) -> int:
        return self.args[1]

    @property
    def uniform(self) -> int:
        return self.args[4]

    @property
    def grid_rows(self) -> int:
        """Fragments per row of a grid kernel's launch (0: a list kernel)."""
        return self.args[5] if len(self.args) > 5 else 0

    def fragments(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(src, dst, length) exactly as the kernel reads them from its table."""
        n, flen, t = self.n, self.uniform, self.table
        r = self.grid_rows
        if r:
            k = n // r
            so, si, do, di = t[:k], t[k:k + r], t[k + r:2 * k + r], t[2 * k + r:2 * k + 2 * r]
            return ((so[:, None] + si[None, :]).ravel(), (do[:, None] + di[None, :]).ravel(),
                    np.full(n, flen, dtype=np.int64))
        lens = np.full(n, flen, dtype=np.int64) if flen > 0 else np.diff(t[2 * n:3 * n + 1])
        return t[:n], t[n:2 * n], lens


class Stub:
    """The fake driver's state; `driver` and `nvrtc` are the modules `cuda.bindings` would provide."""

    def __init__(self, devices: int = 2) -> None:
        self.devices = devices
        self.run_kernels = False
        self.events_pending = False  # True: every event query answers NOT_READY (work still in flight)
        self.record_tables = True
        self.calls: collections.Counter = collections.Counter()
        self.launches: list[Launch] = []
        self.peer_access: list[tuple[int, int]] = []  # (device whose context enabled it, the peer device)
        self._ctx: list[_Handle] = []  # the current-context stack (cuCtxPush/PopCurrent)
        self._allocs: dict[int, tuple[int, int, object]] = {}  # base -> (size, device, keep-alive)
        self._next_range = _RANGE_BASE
        self.driver = self._driver_module()
        self.nvrtc = types.SimpleNamespace(nvrtcVersion=lambda: (CUresult.CUDA_SUCCESS, 12, 8))

    # --- memory the tests and benchmarks use -----------------------------------------------------------
    def device_buffer(self, nbytes: int, device: int) -> np.ndarray:
        """Real bytes standing for an allocation on `device` (page-aligned numpy uint8 array)."""
        raw = np.zeros(nbytes + 4096, dtype=np.uint8)
        off = (-raw.ctypes.data) % 4096
        arr = raw[off:off + nbytes]
        self._allocs[int(arr.ctypes.data)] = (nbytes, device, raw)
        return arr

    def device_range(self, nbytes: int, device: int) -> int:
        """An address range standing for an allocation on `device`, with no memory behind it (timing only)."""
        base = self._next_range
        self._next_range += (nbytes + (1 << 21)) & ~((1 << 21) - 1)
        self._allocs[base] = (nbytes, device, None)
        return base

    def _find(self, ptr: int) -> tuple[int, int]:
        for base, (size, _dev, _keep) in self._allocs.items():
            if base <= ptr < base + size:
                return base, size
        raise KeyError(ptr)

    # --- the driver module -----------------------------------------------------------------------------
    def _driver_module(self) -> types.SimpleNamespace:
        ok = CUresult.CUDA_SUCCESS
        stub = self

        def counted(fn):
            name = fn.__name__

            def call(*a):
                stub.calls[name] += 1
                return fn(*a)
            call.__name__ = name
            return call

        @counted
        def cuInit(flags):
            return (ok,)

        @counted
        def cuGetErrorName(err):
            return ok, CUresult(int(err)).name.encode()

        @counted
        def cuDeviceGetCount():
            return ok, stub.devices

        @counted
        def cuDeviceGet(i):
            return ok, int(i)

        @counted
        def cuDevicePrimaryCtxRetain(dev):
            return ok, _Handle("ctx", device=dev)

        @counted
        def cuDeviceGetPCIBusId(n, dev):
            return ok, f"0000:{0x10 + int(dev):02x}:00.0".encode() + b"\0"

        @counted
        def cuDeviceGetAttribute(attr, dev):
            return ok, {"sm": 132, "major": 9, "minor": 0}[attr]

        @counted
        def cuDeviceCanAccessPeer(a, b):
            return ok, 1

        @counted
        def cuCtxPushCurrent(ctx):
            stub._ctx.append(ctx)
            return (ok,)

        @counted
        def cuCtxPopCurrent():
            return ok, (stub._ctx.pop() if stub._ctx else None)

        @counted
        def cuCtxEnablePeerAccess(ctx, flags):
            stub.peer_access.append((stub.current_device(), int(ctx.device)))
            return (ok,)

        @counted
        def cuMemGetAddressRange(ptr):
            try:
                base, size = stub._find(int(ptr))
            except KeyError:
                return CUresult.CUDA_ERROR_INVALID_VALUE, 0, 0
            return ok, base, size

        @counted
        def cuIpcGetMemHandle(base):
            h = CUipcMemHandle()
            h.reserved = b"stub" + int(base).to_bytes(8, "little") + bytes(52)
            return ok, h

        @counted
        def cuIpcOpenMemHandle(h, flags):
            return ok, int.from_bytes(bytes(h.reserved)[4:12], "little")

        @counted
        def cuIpcCloseMemHandle(ptr):
            return (ok,)

        @counted
        def cuMemHostAlloc(nbytes, flags):
            return ok, int(stub.device_buffer(nbytes, -1).ctypes.data)

        @counted
        def cuMemAlloc(nbytes):
            return ok, int(stub.device_buffer(nbytes, -2).ctypes.data)

        @counted
        def cuMemFreeHost(ptr):
            stub._allocs.pop(int(ptr), None)
            return (ok,)

        @counted
        def cuMemFree(ptr):
            stub._allocs.pop(int(ptr), None)
            return (ok,)

        @counted
        def cuEventCreate(flags):
            return ok, _Handle("event")

        @counted
        def cuEventRecord(ev, stream):
            return (ok,)

        @counted
        def cuEventQuery(ev):
            return (CUresult.CUDA_ERROR_NOT_READY if stub.events_pending else ok,)

        @counted
        def cuEventElapsedTime(a, b):
            return ok, 0.0

        @counted
        def cuEventDestroy(ev):
            return (ok,)

        @counted
        def cuStreamCreate(flags):
            return ok, _Handle("stream")

        @counted
        def cuStreamQuery(stream):
            return (ok,)

        @counted
        def cuStreamWaitEvent(stream, ev, flags):
            return (ok,)

        @counted
        def cuStreamDestroy(stream):
            return (ok,)

        @counted
        def cuMemcpyHtoDAsync(dst, src, nbytes, stream):
            if stub.record_tables or stub.run_kernels:  # timing only: a real upload costs the host nothing
                ctypes.memmove(int(dst), int(src), int(nbytes))
            return (ok,)

        @counted
        def cuModuleLoadData(image):
            return ok, _Handle("module")

        @counted
        def cuModuleGetFunction(module, name):
            return ok, _Handle("function", name=name)

        @counted
        def cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, threads, smem):
            return ok, 8

        @counted
        def cuLaunchKernel(fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
            stub._launch(fn.name, int(gx), int(params))
            return (ok,)

        ns = types.SimpleNamespace(**{k: v for k, v in locals().items() if k.startswith("cu")})
        ns.CUresult = CUresult
        ns.CUipcMemHandle = CUipcMemHandle
        ns.CUdevice_attribute = types.SimpleNamespace(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT="sm",
                                                      CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR="major",
                                                      CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR="minor")
        ns.CUevent_flags = types.SimpleNamespace(CU_EVENT_DISABLE_TIMING=2)
        ns.CUstream_flags = types.SimpleNamespace(CU_STREAM_NON_BLOCKING=1)
        ns.CUipcMem_flags = types.SimpleNamespace(CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS=1)
        return ns

    def current_device(self) -> int | None:
        """The device of the current context (None: no context current)."""
        return int(self._ctx[-1].device) if self._ctx else None

    def _launch(self, name: bytes, grid: int, params: int) -> None:
        at = time.perf_counter()
        if not (self.record_tables or self.run_kernels):  # timing: the launch's time only
            self.launches.append(Launch(name, grid, (), None, at))
            return
        grid_kernel = name.startswith(b"kvb_grid")
        nargs = 6 if grid_kernel else 5
        ptrs = np.ctypeslib.as_array((ctypes.c_uint64 * nargs).from_address(params))
        args = tuple(int(ctypes.c_int64.from_address(int(p)).value) for p in ptrs)
        table_ptr, n, _chunk, _nchunks, flen = args[:5]
        if grid_kernel:
            r = args[5]
            if r <= 0 or flen <= 0 or n % r:
                raise ValueError(f"grid kernel launched with n={n}, r={r}, flen={flen}")
            words = 2 * (n // r + r)
        else:
            words = 2 * n if flen > 0 else 3 * n + 1
        table = None
        if self.record_tables or self.run_kernels:
            table = np.frombuffer((ctypes.c_int64 * words).from_address(table_ptr), dtype=np.int64).copy()
        launch = Launch(name, grid, args, table, at)
        launch.device = self.current_device()
        self.launches.append(launch)
        if self.run_kernels:
            for s, d, ln in zip(*(a.tolist() for a in launch.fragments())):
                ctypes.memmove(d, s, ln)


@contextlib.contextmanager
def installed(devices: int = 2):
    """Make `cuda.bindings` resolve to a fresh Stub for the block (kvbridge's CUDA caches are reset on entry
    and exit, so agents made inside use the stub and nothing of it outlives the block)."""
    from kvbridge.agents import cuda_driver as drv  # absolute: bench/direct_host.py loads this file by path
    from kvbridge.agents import cuda_kernels

    stub = Stub(devices)
    names = ("cuda", "cuda.bindings", "cuda.bindings.driver", "cuda.bindings.nvrtc")
    saved = {k: sys.modules.get(k) for k in names}
    pkg, bindings = types.ModuleType("cuda"), types.ModuleType("cuda.bindings")
    bindings.driver, bindings.nvrtc, pkg.bindings = stub.driver, stub.nvrtc, bindings
    sys.modules.update({"cuda": pkg, "cuda.bindings": bindings, "cuda.bindings.driver": stub.driver,
                        "cuda.bindings.nvrtc": stub.nvrtc})

    def reset() -> None:
        drv._cu = drv._nvrtc = None
        drv.Device._cache.clear()
        drv.IpcMappings._open.clear()
        cuda_kernels.FragmentCopier._cache.clear()

    reset()
    cubins = dict(cuda_kernels._cubins)
    cuda_kernels._cubins[(90, 0)] = b"stub cubin"
    try:
        yield stub
    finally:
        reset()
        cuda_kernels._cubins.clear()
        cuda_kernels._cubins.update(cubins)
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
