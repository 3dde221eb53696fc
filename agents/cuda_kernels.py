"""The fragment-copy kernel: one launch moves every (src, dst, len) fragment of a transfer.

Owns the CUDA C source, its run-time compilation (NVRTC, to the device's own SASS), loading it into each
device's primary context, and the launch geometry. Never validates addresses: callers (the cuda_ipc agent)
bounds-check every fragment against registered regions before they reach `FragmentCopier.launch`.

How work is split. The descriptor table is three int64 arrays uploaded in one H2D copy: source addresses,
destination addresses, and the exclusive prefix sum of fragment lengths (`cum`, n + 1 entries). The bytes
of all fragments, laid end to end, form one stream of `cum[n]` bytes cut into fixed chunks of `chunk`
bytes. Each warp takes chunks grid-stride, finds the fragment holding its chunk's first byte with a 32-ary
warp-wide search of `cum` (4 rounds for 1M fragments), then copies the fragment pieces overlapping its
chunk. So a 4 MiB fragment is spread over hundreds of warps on every SM, while hundreds of 4 KiB fragments
share one CTA; the kernel's speed does not depend on fragment size once a fragment fills a warp's loads.

A DescriptorGrid READ (every fragment one length, fragment i * r + j at outer[i] + inner[j] on each side) goes
to the grid kernels instead: the table is the grid's own arrays (k + r words a side instead of k * r) and each
warp forms its fragments' addresses, so the host writes and uploads a few KiB instead of 16 bytes a fragment.

Each piece is copied with the widest word both ends share an alignment for (16, 8, 4, 2 or 1 bytes): head
bytes up to the source's word boundary, then words (8 loads in flight per lane before the first store), then
tail bytes. Any alignment and any length is correct; 16-byte-aligned KV blocks take the 16-byte path.
"""

from __future__ import annotations

import enum
import hashlib
import os
import threading
from dataclasses import dataclass

import numpy as np

from ..errors import AgentError
from .cuda_driver import Device, check, load, nvrtc_module

THREADS = 256  # 8 warps per CTA
DEFAULT_CHUNK = 16 << 10  # bytes per warp work item (shrunk for small transfers, see `geometry`)
MIN_CHUNK = 1 << 10


class CopyKernel(enum.Enum):
    """Which kernel variant copies the fragments."""

    ANY = "any"          # 16-, 8-, 4-, 2- or 1-byte words per piece: correct for any alignment (the default)
    ALIGNED = "aligned"  # 16-byte words only: ONLY where src % 16 == dst % 16 for every fragment (benchmarks)


@dataclass(frozen=True, slots=True)
class CopyTuning:
    """Launch knobs of the fragment copy (the cuda_ipc agent's `tuning`); the defaults suit every transfer.

    Attributes:
        kernel: the kernel variant (see CopyKernel; ALIGNED is wrong for misaligned fragments).
        chunk: bytes per warp work item, within [512, 1 GiB]; None: chosen per transfer (`geometry`).
        max_blocks: cap on CTAs per launch (>= 1); None: full occupancy.
    """

    kernel: CopyKernel = CopyKernel.ANY
    chunk: int | None = None
    max_blocks: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kernel, CopyKernel):
            raise AgentError(f"kernel must be a CopyKernel, got {self.kernel!r}")
        if self.chunk is not None and (type(self.chunk) is not int or not 512 <= self.chunk <= (1 << 30)):
            raise AgentError(f"chunk must be an int within [512, 1 GiB] bytes, got {self.chunk!r}")
        if self.max_blocks is not None and (type(self.max_blocks) is not int or self.max_blocks < 1):
            raise AgentError(f"max_blocks must be an int >= 1, got {self.max_blocks!r}")

SOURCE = r"""
typedef long long i64;
typedef unsigned long long u64;
struct alignas(16) v16 { u64 lo, hi; };

template <typename T> __device__ __forceinline__ T ld(const T* p) { return *p; }
template <typename T> __device__ __forceinline__ void st(T* p, const T& v) { *p = v; }
template <> __device__ __forceinline__ v16 ld<v16>(const v16* p) {
  v16 v;
  asm volatile("ld.global.v2.u64 {%0, %1}, [%2];" : "=l"(v.lo), "=l"(v.hi) : "l"(p));
  return v;
}
template <> __device__ __forceinline__ void st<v16>(v16* p, const v16& v) {
  asm volatile("st.global.v2.u64 [%0], {%1, %2};" :: "l"(p), "l"(v.lo), "l"(v.hi) : "memory");
}

// Copy n bytes s -> d with one warp, in words of T; requires (s - d) % sizeof(T) == 0.
template <typename T, int U>
__device__ __forceinline__ void copy_words(const char* s, char* d, i64 n, int lane) {
  constexpr i64 W = sizeof(T);
  i64 head = (i64)((0ull - (u64)s) & (u64)(W - 1));
  if (head > n) head = n;
  if (lane < head) d[lane] = s[lane];
  s += head; d += head; n -= head;
  const T* sv = reinterpret_cast<const T*>(s);
  T* dv = reinterpret_cast<T*>(d);
  const i64 nv = n / W;
  for (i64 k = lane; k < nv; k += U * 32) {  // U loads in flight per lane before the first store
    const T* p = sv + k;
    T* q = dv + k;
    const i64 left = nv - k;
    T r[U];
#pragma unroll
    for (int u = 0; u < U; ++u) if (u * 32 < left) r[u] = ld(p + u * 32);
#pragma unroll
    for (int u = 0; u < U; ++u) if (u * 32 < left) st(q + u * 32, r[u]);
  }
  const i64 t = n - nv * W;
  if (lane < t) d[nv * W + lane] = s[nv * W + lane];
}

// ALIGNED: the caller guarantees (s - d) % 16 == 0 for every piece, so only the 16-byte path is built.
template <bool ALIGNED>
__device__ __forceinline__ void copy_piece(const char* s, char* d, i64 n, int lane) {
  const unsigned mis = (unsigned)(((u64)s ^ (u64)d) & 15ull);
  if (ALIGNED || mis == 0) copy_words<v16, 8>(s, d, n, lane);
  else if ((mis & 7u) == 0) copy_words<u64, 4>(s, d, n, lane);
  else if ((mis & 3u) == 0) copy_words<unsigned, 4>(s, d, n, lane);
  else if ((mis & 1u) == 0) copy_words<unsigned short, 4>(s, d, n, lane);
  else copy_words<unsigned char, 4>(s, d, n, lane);
}

// Largest i in [0, n) with cum[i] <= x, for 0 <= x < cum[n] and cum strictly increasing. Warp-uniform.
__device__ __forceinline__ i64 find_fragment(const i64* cum, i64 n, i64 x, int lane) {
  i64 lo = 0, hi = n;
  while (hi - lo > 1) {
    const i64 step = (hi - lo + 31) >> 5;
    const i64 p = lo + (i64)(lane + 1) * step;
    const bool le = p < hi && cum[p] <= x;
    const unsigned m = __ballot_sync(0xffffffffu, le);
    lo += (i64)__popc(m) * step;
    hi = min(hi, lo + step);
  }
  return lo;
}

// table = src[n] | dst[n] | cum[n + 1] (int64 addresses and byte offsets). When every fragment has the same
// length flen > 0 the table is src[n] | dst[n] only and cum[i] = i * flen (no search, a third less upload).
template <bool ALIGNED>
__device__ __forceinline__ void copy_fragments(const i64* __restrict__ table, i64 n, i64 chunk, i64 nchunks,
                                               i64 flen) {
  const i64* src = table;
  const i64* dst = table + n;
  const i64* cum = table + 2 * n;
  const int lane = threadIdx.x & 31;
  const i64 nwarps = ((i64)gridDim.x * blockDim.x) >> 5;
  const i64 total = flen > 0 ? n * flen : cum[n];
  for (i64 c = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; c < nchunks; c += nwarps) {
    i64 begin = c * chunk;
    const i64 end = min(begin + chunk, total);
    i64 i = flen > 0 ? begin / flen : find_fragment(cum, n, begin, lane);
    i64 fstart = flen > 0 ? i * flen : cum[i];
    while (begin < end) {
      const i64 fend = flen > 0 ? fstart + flen : cum[i + 1];
      const i64 stop = min(end, fend);
      const i64 off = begin - fstart;
      copy_piece<ALIGNED>(reinterpret_cast<const char*>(src[i]) + off, reinterpret_cast<char*>(dst[i]) + off,
                          stop - begin, lane);
      begin = stop;
      fstart = fend;
      ++i;
    }
  }
}

// A grid of n = k * r fragments of flen bytes each: fragment i = row * r + col is at outer[row] + inner[col]
// on each side, and the table is src_outer[k] | src_inner[r] | dst_outer[k] | dst_inner[r] (k + r words a side
// instead of n). The same chunking as copy_fragments' equal-length case.
template <bool ALIGNED>
__device__ __forceinline__ void copy_grid(const i64* __restrict__ table, i64 n, i64 chunk, i64 nchunks, i64 flen,
                                          i64 r) {
  const i64 k = n / r;
  const i64* src = table;
  const i64* dst = table + k + r;
  const int lane = threadIdx.x & 31;
  const i64 nwarps = ((i64)gridDim.x * blockDim.x) >> 5;
  const i64 total = n * flen;
  for (i64 c = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; c < nchunks; c += nwarps) {
    i64 begin = c * chunk;
    const i64 end = min(begin + chunk, total);
    i64 i = begin / flen;
    i64 fstart = i * flen;
    while (begin < end) {
      const i64 fend = fstart + flen;
      const i64 stop = min(end, fend);
      const i64 off = begin - fstart;
      const i64 row = i / r, col = i - row * r;
      copy_piece<ALIGNED>(reinterpret_cast<const char*>(src[row] + src[k + col]) + off,
                          reinterpret_cast<char*>(dst[row] + dst[k + col]) + off, stop - begin, lane);
      begin = stop;
      fstart = fend;
      ++i;
    }
  }
}

extern "C" __global__ void __launch_bounds__(256)
kvb_grid_aligned(const i64* __restrict__ table, i64 n, i64 chunk, i64 nchunks, i64 flen, i64 r) {
  copy_grid<true>(table, n, chunk, nchunks, flen, r);
}

extern "C" __global__ void __launch_bounds__(256)
kvb_grid_any(const i64* __restrict__ table, i64 n, i64 chunk, i64 nchunks, i64 flen, i64 r) {
  copy_grid<false>(table, n, chunk, nchunks, flen, r);
}

// Every fragment has src % 16 == dst % 16: the 16-byte path only (fewer registers, more warps per SM).
extern "C" __global__ void __launch_bounds__(256)
kvb_copy_aligned(const i64* __restrict__ table, i64 n, i64 chunk, i64 nchunks, i64 flen) {
  copy_fragments<true>(table, n, chunk, nchunks, flen);
}

// Any alignment: each piece takes the widest word its two ends share.
extern "C" __global__ void __launch_bounds__(256)
kvb_copy_any(const i64* __restrict__ table, i64 n, i64 chunk, i64 nchunks, i64 flen) {
  copy_fragments<false>(table, n, chunk, nchunks, flen);
}
"""

_cubins: dict[tuple[int, int], bytes] = {}
_compile_lock = threading.Lock()


def _cache_path(cc: tuple[int, int], nvrtc) -> str:
    """Where a compiled cubin is kept between processes (KVBRIDGE_CACHE_DIR, else ~/.cache/kvbridge)."""
    ver = ".".join(str(v) for v in check(nvrtc.nvrtcVersion(), "nvrtcVersion"))
    digest = hashlib.sha256(f"{SOURCE}|sm_{cc[0]}{cc[1]}|{ver}".encode()).hexdigest()[:24]
    root = os.environ.get("KVBRIDGE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvbridge")
    return os.path.join(root, "kernels", f"copy_{digest}.cubin")


def compile_source(cc: tuple[int, int], *, ptx: bool = False) -> bytes:
    """NVRTC-compile SOURCE for compute capability `cc`: SASS (cubin) by default, or PTX text.

    Cubins are cached in memory and on disk (see `_cache_path`), so only a machine's first process pays
    for compilation.
    """
    nvrtc = nvrtc_module()
    key = (cc[0] * 10 + cc[1], int(ptx))
    with _compile_lock:
        if not ptx and key in _cubins:
            return _cubins[key]
        path = _cache_path(cc, nvrtc)
        if not ptx and os.path.exists(path):
            try:
                with open(path, "rb") as f:
                    _cubins[key] = f.read()
                return _cubins[key]
            except OSError:
                pass
        prog = check(nvrtc.nvrtcCreateProgram(SOURCE.encode(), b"kvb_copy.cu", 0, [], []),
                     "nvrtcCreateProgram")
        try:
            arch = f"--gpu-architecture={'compute' if ptx else 'sm'}_{cc[0]}{cc[1]}".encode()
            opts = [arch, b"-std=c++17", b"-default-device"]
            (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
            if int(err) != 0:
                size = check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
                log = b" " * size
                nvrtc.nvrtcGetProgramLog(prog, log)
                raise AgentError(f"NVRTC could not compile the fragment-copy kernel for sm_{cc[0]}{cc[1]}: "
                                 f"{log.decode(errors='replace').strip()}")
            if ptx:
                size = check(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
                out = b" " * size
                check(nvrtc.nvrtcGetPTX(prog, out), "nvrtcGetPTX")
                return out
            size = check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
            out = b" " * size
            check(nvrtc.nvrtcGetCUBIN(prog, out), "nvrtcGetCUBIN")
            _cubins[key] = out
            try:  # best effort: an unwritable cache only costs the next process a compile
                os.makedirs(os.path.dirname(path), exist_ok=True)
                tmp = f"{path}.{os.getpid()}.tmp"
                with open(tmp, "wb") as f:
                    f.write(out)
                os.replace(tmp, path)
            except OSError:
                pass
            return out
        finally:
            nvrtc.nvrtcDestroyProgram(prog)


class FragmentCopier:
    """The kernels loaded on one device, with their launch geometry. One per device per process."""

    _cache: dict[int, "FragmentCopier"] = {}
    _lock = threading.Lock()

    def __init__(self, device: Device) -> None:
        cu, _ = load()
        self.device = device
        image = compile_source(device.cc)
        self._fn: dict[tuple[bool, bool], object] = {}  # (aligned, grid) -> kernel
        self._blocks: dict[tuple[bool, bool], int] = {}
        with device.current():
            self._module = check(cu.cuModuleLoadData(image), "cuModuleLoadData")
            for key, name in (((True, False), b"kvb_copy_aligned"), ((False, False), b"kvb_copy_any"),
                              ((True, True), b"kvb_grid_aligned"), ((False, True), b"kvb_grid_any")):
                fn = check(cu.cuModuleGetFunction(self._module, name), "cuModuleGetFunction")
                per_sm = int(check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, THREADS, 0),
                                   "cuOccupancyMaxActiveBlocksPerMultiprocessor"))
                self._fn[key] = fn
                self._blocks[key] = max(1, per_sm) * device.sm_count
        self.max_blocks: dict[bool, int] = {a: self._blocks[(a, False)] for a in (True, False)}  # list kernels

    @classmethod
    def get(cls, device: Device) -> "FragmentCopier":
        with cls._lock:
            c = cls._cache.get(device.ordinal)
            if c is None:
                c = cls._cache[device.ordinal] = FragmentCopier(device)
            return c

    def geometry(self, total: int, aligned: bool, chunk: int | None = None,
                 max_blocks: int | None = None, grid: bool = False) -> tuple[int, int, int]:
        """(chunk bytes, number of chunks, CTAs) for a transfer of `total` bytes."""
        full = self._blocks[(aligned, grid)]
        cap = min(max_blocks or full, full)
        if chunk is None:
            # a few chunks for every resident warp, but never chunks too small to keep 8 loads per lane busy
            want = -(-total // (cap * (THREADS // 32) * 4))
            chunk = min(DEFAULT_CHUNK, max(MIN_CHUNK, -(-want // 512) * 512))
        nchunks = -(-total // chunk)
        blocks = min(cap, -(-nchunks // (THREADS // 32)))
        return chunk, nchunks, max(1, blocks)

    def launch(self, table_dev: int, n: int, total: int, aligned: bool, stream, *, uniform: int = 0,
               chunk: int | None = None, max_blocks: int | None = None, args: "KernelArgs | None" = None,
               current: bool = False, grid: int = 0) -> None:
        """Enqueue one copy of all `n` fragments described by the device table at `table_dev` on `stream`.

        Args:
            table_dev: device address of src[n] | dst[n] | cum[n + 1] (int64), or of src[n] | dst[n] when
                `uniform` > 0; already on this device.
            n: number of fragments (> 0).
            total: the bytes to move (cum[n], or n * uniform).
            aligned: True only if src % 16 == dst % 16 for every fragment (selects the 16-byte-only kernel).
            stream: a CUstream of this device.
            uniform: the length of every fragment when they are all equal, else 0.
            chunk, max_blocks: override the launch geometry (benchmarks and tests).
            args: a KernelArgs the caller owns until the launch returns (none: one is made here).
            current: this device's context is already current (the caller pushed it).
            grid: > 0: the fragments are a grid of n / grid rows of `grid` (the grid kernel, `uniform` > 0
                required) and the table is src_outer | src_inner | dst_outer | dst_inner (n / grid + grid words
                a side); 0: the table above.
        """
        cu, _ = load()
        g = grid > 0
        if g and (uniform <= 0 or n % grid):
            raise AgentError(f"a grid launch needs equal lengths and whole rows, got n={n}, r={grid}, "
                             f"length={uniform}")
        chunk, nchunks, blocks = self.geometry(total, aligned, chunk, max_blocks, g)
        args = args if args is not None else KernelArgs()
        args.values[:] = (table_dev, n, chunk, nchunks, uniform, grid)
        ptrs, fn = args.address, self._fn[(aligned, g)]
        if current:
            check(cu.cuLaunchKernel(fn, blocks, 1, 1, THREADS, 1, 1, 0, stream, ptrs, 0),
                  f"cuLaunchKernel(fragment copy, {blocks} CTAs)")
            return
        with self.device.current():
            check(cu.cuLaunchKernel(fn, blocks, 1, 1, THREADS, 1, 1, 0, stream, ptrs, 0),
                  f"cuLaunchKernel(fragment copy, {blocks} CTAs)")


class KernelArgs:
    """A launch's argument block, made once and filled per launch: the six int64 kernel arguments (`values`;
    the list kernels take the first five, the driver reads no more than a kernel has),
    the array of pointers to them, and that array's address (`address`, what cuLaunchKernel takes). One
    launch at a time uses it (a slot's own block, or a fresh one); the driver copies the values at launch."""

    __slots__ = ("values", "ptrs", "address")

    def __init__(self) -> None:
        self.values = np.zeros(6, dtype=np.int64)
        base = self.values.__array_interface__["data"][0]
        self.ptrs = np.arange(6, dtype=np.uint64) * np.uint64(8) + np.uint64(base)
        self.address = int(self.ptrs.__array_interface__["data"][0])
