"""The thin layer over NVIDIA's CUDA driver API (`cuda-bindings`) that the cuda_ipc agent stands on.

Owns: the lazy import of `cuda.bindings` (so kvbridge imports on machines with no GPU or no driver), result
checking that turns CUDA error codes into kvbridge errors naming the call, per-device primary contexts made
current only for the span of a call (the caller's current device is left as it was), pinned host and
device buffers, IPC handle export/import with a per-process cache, and this host's identity.

Never does: data movement decisions (that is `cuda_kernels`), waits without a deadline, or any call on a
device the caller did not name. Every function here raises AgentError (or a subclass) on failure.
"""

from __future__ import annotations

import ctypes
import socket
import threading
import uuid

import numpy as np

from ..errors import AgentError

_cu = None
_nvrtc = None
_import_lock = threading.Lock()

# One random token per process: two agents with the same token share an address space (no IPC needed).
PROCESS_TOKEN = uuid.uuid4().hex


def load() -> tuple[object, object]:
    """The `cuda.bindings` driver and nvrtc modules, with the driver initialised; AgentError if unusable."""
    global _cu, _nvrtc
    if _cu is not None:  # loaded: no lock on the hot path (set once, under the lock, never unset but by tests)
        return _cu, _nvrtc
    with _import_lock:
        if _cu is None:
            try:
                from cuda.bindings import driver as cu, nvrtc  # type: ignore[import-not-found]
            except ImportError:
                try:
                    from cuda import cuda as cu, nvrtc  # type: ignore[import-not-found,no-redef]  # < 12.6
                except ImportError as e:
                    raise AgentError("the cuda_ipc agent needs NVIDIA's CUDA Python bindings: pip install "
                                     f"'kvbridge[gpu]' (cuda-bindings); importing them failed: {e}") from None
            try:
                (err,) = cu.cuInit(0)
            except RuntimeError as e:  # libcuda.so.1 missing: no NVIDIA driver on this machine
                raise AgentError(f"the cuda_ipc agent needs an NVIDIA GPU and driver; {e}") from None
            if int(err) != 0:
                raise AgentError(f"the cuda_ipc agent needs an NVIDIA GPU and driver; cuInit failed: "
                                 f"{error_name(cu, err)}")
            _cu, _nvrtc = cu, nvrtc
        return _cu, _nvrtc


def nvrtc_module():
    """NVRTC's bindings alone (compiling needs no GPU and no driver); AgentError if not installed."""
    try:
        from cuda.bindings import nvrtc  # type: ignore[import-not-found]
    except ImportError:
        try:
            from cuda import nvrtc  # type: ignore[import-not-found,no-redef]
        except ImportError as e:
            raise AgentError(f"NVRTC bindings are missing: pip install 'kvbridge[gpu]' ({e})") from None
    try:
        nvrtc.nvrtcVersion()
    except Exception as e:  # noqa: BLE001 - the bindings raise their own error when libnvrtc is missing
        raise AgentError(f"the NVRTC library (libnvrtc) could not be loaded; pip install 'kvbridge[gpu]' "
                         f"or put the CUDA toolkit's lib64 on LD_LIBRARY_PATH: {e}") from None
    return nvrtc


def error_name(cu, err) -> str:
    try:
        e2, s = cu.cuGetErrorName(err)
        return s.decode() if int(e2) == 0 else str(err)
    except Exception:  # noqa: BLE001
        return str(err)


def check(result, what: str, exc: type[AgentError] = AgentError):
    """Unpack a cuda-bindings result tuple (err, *values); raise `exc` naming `what` unless err is success."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise exc(f"{what} failed: {error_name(_cu, err)}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


def device_count() -> int:
    cu, _ = load()
    return int(check(cu.cuDeviceGetCount(), "cuDeviceGetCount"))


class _Current:
    """`with device.current():` (a plain class: a generator-based context manager costs ~1 us more per use, and
    transfers and polls enter one each time)."""

    __slots__ = ("_dev",)

    def __init__(self, dev: Device) -> None:
        self._dev = dev

    def __enter__(self) -> Device:
        r = _cu.cuCtxPushCurrent(self._dev.ctx)
        err = r[0] if isinstance(r, tuple) else r
        if int(err) != 0:
            raise AgentError(f"cuCtxPushCurrent(device {self._dev.ordinal}) failed: {error_name(_cu, err)}")
        return self._dev

    def __exit__(self, *exc) -> None:
        _cu.cuCtxPopCurrent()


class Device:
    """One CUDA device's primary context (the one torch and the runtime API use), retained for our life."""

    _cache: dict[int, "Device"] = {}
    _lock = threading.Lock()

    def __init__(self, ordinal: int) -> None:
        cu, _ = load()
        n = device_count()
        if not 0 <= ordinal < n:
            raise AgentError(f"CUDA device {ordinal} does not exist here ({n} visible)")
        self.ordinal = ordinal
        self.dev = check(cu.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
        self.ctx = check(cu.cuDevicePrimaryCtxRetain(self.dev), f"cuDevicePrimaryCtxRetain({ordinal})")
        self.pci_bus_id = pci_bus_id(ordinal)
        attr = cu.CUdevice_attribute
        self.sm_count = int(check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                                                          self.dev), "cuDeviceGetAttribute"))
        self.cc = (int(check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                                                     self.dev), "cuDeviceGetAttribute")),
                   int(check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                                                     self.dev), "cuDeviceGetAttribute")))
        self._peers_enabled: set[int] = set()

    @classmethod
    def get(cls, ordinal: int) -> "Device":
        with cls._lock:
            d = cls._cache.get(ordinal)
            if d is None:
                d = cls._cache[ordinal] = Device(ordinal)
            return d

    def current(self) -> _Current:
        """Make this device's primary context current for the block; the caller's context is restored."""
        return _Current(self)

    def enable_peer_access(self, peer: "Device") -> None:
        """Let kernels here touch `peer`'s memory (idempotent); AgentError if the link forbids it."""
        if peer.ordinal == self.ordinal or peer.ordinal in self._peers_enabled:
            return
        cu = _cu
        ok = check(cu.cuDeviceCanAccessPeer(self.dev, peer.dev), "cuDeviceCanAccessPeer")
        if not ok:
            raise AgentError(f"CUDA device {self.ordinal} cannot access device {peer.ordinal}'s memory "
                             "(no peer-to-peer path between them)")
        with self.current():
            (err,) = cu.cuCtxEnablePeerAccess(peer.ctx, 0)
        if int(err) not in (0, int(cu.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED)):
            raise AgentError(f"cuCtxEnablePeerAccess({self.ordinal} -> {peer.ordinal}) failed: "
                             f"{error_name(cu, err)}")
        self._peers_enabled.add(peer.ordinal)

    def can_access_peer(self, ordinal: int) -> bool:
        """Whether kernels here can reach device `ordinal`'s memory (asks the driver; creates no context)."""
        if ordinal == self.ordinal:
            return True
        peer = check(_cu.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
        return bool(check(_cu.cuDeviceCanAccessPeer(self.dev, peer), "cuDeviceCanAccessPeer"))


def pci_bus_id(ordinal: int) -> str:
    """The PCI bus id ('0000:1b:00.0') of visible device `ordinal`: its name in every process of the host."""
    cu, _ = load()
    dev = check(cu.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
    raw = check(cu.cuDeviceGetPCIBusId(32, dev), "cuDeviceGetPCIBusId")
    raw = raw.split(b"\x00")[0].decode() if isinstance(raw, (bytes, bytearray)) else str(raw).split("\x00")[0]
    return raw.strip().lower()


def ordinal_by_pci(bus_id: str) -> int | None:
    """This process's ordinal for the device with PCI bus id `bus_id`, or None if it cannot see it.

    Creates no context on that device (unlike `Device.get`).
    """
    for i in range(device_count()):
        if pci_bus_id(i) == bus_id.strip().lower():
            return i
    return None


def allocation_of(ptr: int, device: Device) -> tuple[int, int]:
    """(base, size) of the cudaMalloc allocation holding `ptr` (caching allocators hand out sub-ranges)."""
    cu = _cu
    with device.current():
        base, size = check(cu.cuMemGetAddressRange(ptr), f"cuMemGetAddressRange({ptr:#x})", AgentError)
    return int(base), int(size)


def export_handle(base: int, device: Device) -> bytes:
    """The 64-byte CUDA IPC handle of the allocation starting at `base`."""
    cu = _cu
    with device.current():
        h = check(cu.cuIpcGetMemHandle(base), f"cuIpcGetMemHandle({base:#x})")
    return bytes(h.reserved)


class IpcMappings:
    """Process-wide cache of opened IPC handles: each (device, handle) is opened once and ref-counted."""

    _open: dict[tuple[int, bytes], list[int]] = {}  # -> [mapped base, refcount]
    _lock = threading.Lock()

    @classmethod
    def acquire(cls, handle: bytes, device: Device) -> int:
        key = (device.ordinal, handle)
        with cls._lock:
            hit = cls._open.get(key)
            if hit is not None:
                hit[1] += 1
                return hit[0]
            cu = _cu
            h = cu.CUipcMemHandle()
            h.reserved = handle
            with device.current():
                ptr = check(cu.cuIpcOpenMemHandle(
                    h, int(cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)), "cuIpcOpenMemHandle")
            cls._open[key] = [int(ptr), 1]
            return int(ptr)

    @classmethod
    def release(cls, handle: bytes, device: Device) -> None:
        key = (device.ordinal, handle)
        with cls._lock:
            hit = cls._open.get(key)
            if hit is None:
                return
            hit[1] -= 1
            if hit[1] > 0:
                return
            del cls._open[key]
            with device.current():
                _cu.cuIpcCloseMemHandle(hit[0])


class PinnedBuffer:
    """Page-locked host memory as a numpy int64 array (for one-copy H2D descriptor uploads)."""

    def __init__(self, nbytes: int, device: Device) -> None:
        cu = _cu
        self.nbytes = nbytes
        with device.current():
            self.ptr = int(check(cu.cuMemHostAlloc(nbytes, 0), f"cuMemHostAlloc({nbytes})"))
        raw = (ctypes.c_char * nbytes).from_address(self.ptr)
        self.words = np.frombuffer(raw, dtype=np.int64)
        self._device = device

    def free(self) -> None:
        if self.ptr:
            self.words = None
            with self._device.current():
                _cu.cuMemFreeHost(self.ptr)
            self.ptr = 0


class DeviceBuffer:
    """Plain device memory (cuMemAlloc) on one device."""

    def __init__(self, nbytes: int, device: Device) -> None:
        self.nbytes = nbytes
        self._device = device
        with device.current():
            self.ptr = int(check(_cu.cuMemAlloc(nbytes), f"cuMemAlloc({nbytes}) on device {device.ordinal}"))

    def free(self) -> None:
        if self.ptr:
            with self._device.current():
                _cu.cuMemFree(self.ptr)
            self.ptr = 0


def host_identity() -> tuple[str, str]:
    """(hostname, boot id): equal for two processes only if they run on the same booted machine."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return socket.gethostname(), boot


