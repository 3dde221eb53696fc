"""kernel_sweep's copy-engine rows (`--only extras`): can the copy engine carry scattered fragments, alone or
beside the kernel, faster than the kernel's ~374 GB/s SM-driven NVLink reads?

For the current uniform layout of a `Sweep` (bench/kernel_sweep.py):
  - memcpy_peer_on_src: one 1 GiB cudaMemcpyPeerAsync issued on the SOURCE GPU's stream (the ceiling's twin);
  - batch_<flags>: every fragment in one cuMemcpyBatchAsync (CUDA 12.8+), on GPU0's stream;
  - probe_kernel+ce_<MiB>: today's kernel on all fragments while one contiguous cudaMemcpyPeerAsync of MiB
    more bytes runs on a second stream (aggregate GB/s: does SM + copy-engine traffic exceed either alone?);
  - hybrid_ce<f>: one transfer split: the kernel copies fragments [m, n), cuMemcpyBatchAsync [0, m), m = f * n,
    concurrently (the whole destination verified).
"""

from __future__ import annotations

import json
import time

import numpy as np


def _emit(out, sw, row: dict) -> None:
    row = dict(row, layout="uniform", fragment_bytes=sw.flen, fragments=sw.n)
    print(json.dumps(row), file=out, flush=True)
    print(f"{row['name']:28} {sw.flen:6} {row.get('gbps', 'ERR')!s:>7} {row.get('verified', row.get('error', ''))}",
          flush=True)


class Batch:
    """cuMemcpyBatchAsync of fragments [lo, hi) of the current layout, GPU1 -> GPU0."""

    def __init__(self, sw, lo: int, hi: int, overlap: bool) -> None:
        from cuda.bindings import driver as cu

        self.cu = cu
        self.dsts = [cu.CUdeviceptr(int(x)) for x in sw.da[lo:hi]]
        self.srcs = [cu.CUdeviceptr(int(x)) for x in sw.sa[lo:hi]]
        self.sizes = [int(x) for x in sw.lens[lo:hi]]
        a = cu.CUmemcpyAttributes()
        a.srcAccessOrder = cu.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        a.srcLocHint.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        a.srcLocHint.id = 1
        a.dstLocHint.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        a.dstLocHint.id = 0
        a.flags = (cu.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE if overlap
                   else cu.CUmemcpyFlags.CU_MEMCPY_FLAG_DEFAULT)
        self.attrs = [a]
        self.host_ms: list[float] = []

    def __call__(self, stream) -> None:
        t0 = time.perf_counter()
        res = self.cu.cuMemcpyBatchAsync(self.dsts, self.srcs, self.sizes, len(self.sizes), self.attrs, [0], 1,
                                         self.cu.CUstream(stream.ptr))
        self.host_ms.append((time.perf_counter() - t0) * 1e3)
        err = res[0] if isinstance(res, tuple) else res
        if int(err) != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync: {err}")


def _kernel(sw, lo: int, hi: int):
    """Today's kernel (kvb_copy_any, the repo's geometry) over fragments [lo, hi): a launch(stream) closure."""
    cp = sw.cp
    fn = sw.module(dict(kind="sm", src={}, name="base"), 0)
    n = hi - lo
    with cp.cuda.Device(0):
        table = cp.asarray(np.concatenate([sw.sa[lo:hi], sw.da[lo:hi], np.zeros(n + 1, dtype=np.int64)]))
    per_sm = sw.occupancy(fn, 256, 0)
    cap = per_sm * sw.sms
    moved = n * sw.flen
    want = -(-moved // (cap * 8 * 4))
    chunk = min(16 << 10, max(1 << 10, -(-want // 512) * 512))
    nchunks = -(-moved // chunk)
    blocks = max(1, min(cap, -(-nchunks // 8)))
    args = (table, np.int64(n), np.int64(chunk), np.int64(nchunks), np.int64(sw.flen))

    def launch(stream) -> None:
        with stream:
            fn((blocks,), (256,), args)
    launch.table = table  # kept alive with the closure
    return launch


def _check(sw) -> bool:
    cp = sw.cp
    with cp.cuda.Device(0):
        return bool(cp.array_equal(sw.dst, sw.expect))


def _poison(sw) -> None:
    cp = sw.cp
    with cp.cuda.Device(0):
        sw.dst.fill(0xA5)
        cp.cuda.Device(0).synchronize()


def _gbps(nbytes: int, ms: list[float]) -> dict:
    med = float(np.median(ms))
    return dict(ms=round(med, 4), gbps=round(nbytes / (med * 1e-3) / 1e9, 1),
                best_gbps=round(nbytes / (min(ms) * 1e-3) / 1e9, 1))


def extras(sw, out) -> None:
    cp = sw.cp
    total = sw.n * sw.flen
    with cp.cuda.Device(0):
        s2 = cp.cuda.Stream(non_blocking=True)

    def both(first, second):
        """first on s0 and second on s2, concurrently; s0 waits for s2 (what _time's events bracket)."""
        def go() -> None:
            e = cp.cuda.Event(disable_timing=True)
            e.record(sw.s0)
            s2.wait_event(e)
            first(sw.s0)
            second(s2)
            e2 = cp.cuda.Event(disable_timing=True)
            e2.record(s2)
            sw.s0.wait_event(e2)
        return go

    def go_src() -> None:
        cp.cuda.runtime.memcpyPeerAsync(sw.dst.data.ptr, 0, sw.src.data.ptr, 1, sw.total, sw.s1.ptr)
    try:
        _emit(out, sw, dict(name="memcpy_peer_on_src", **_gbps(sw.total, sw._time(go_src, 1, sw.s1))))
    except Exception as e:  # noqa: BLE001
        _emit(out, sw, dict(name="memcpy_peer_on_src", error=f"{type(e).__name__}: {e}"[:300]))

    kernel = _kernel(sw, 0, sw.n)
    _poison(sw)
    _emit(out, sw, dict(name="kernel_base", **_gbps(total, sw._time(lambda: kernel(sw.s0), 0, sw.s0)),
                        verified=_check(sw)))

    for overlap in (False, True):
        name = f"batch_{'overlap' if overlap else 'default'}"
        try:
            b = Batch(sw, 0, sw.n, overlap)
            _poison(sw)
            ms = sw._time(lambda b=b: b(sw.s0), 0, sw.s0)
            _emit(out, sw, dict(name=name, **_gbps(total, ms), verified=_check(sw),
                                host_ms=round(float(np.median(b.host_ms)), 3)))
        except Exception as e:  # noqa: BLE001
            _emit(out, sw, dict(name=name, error=f"{type(e).__name__}: {e}"[:300]))

    extra = 512 << 20  # kernel + a concurrent contiguous copy-engine copy into a second buffer
    with cp.cuda.Device(0):
        dst2 = cp.empty(extra, dtype=cp.uint8)

    def ce(stream) -> None:
        cp.cuda.runtime.memcpyPeerAsync(dst2.data.ptr, 0, sw.src.data.ptr, 1, extra, stream.ptr)
    _poison(sw)
    ms = sw._time(both(kernel, ce), 0, sw.s0)
    with cp.cuda.Device(0):
        ok2 = bool(cp.array_equal(dst2, sw.srcl[:extra]))
    _emit(out, sw, dict(name=f"probe_kernel+ce_{extra >> 20}", **_gbps(total + extra, ms),
                        verified=_check(sw) and ok2))

    for f in (0.1, 0.2, 0.3):
        m = int(sw.n * f)
        name = f"hybrid_ce{f}"
        try:
            k = _kernel(sw, m, sw.n)
            b = Batch(sw, 0, m, False)
            _poison(sw)
            ms = sw._time(both(k, b), 0, sw.s0)
            _emit(out, sw, dict(name=name, **_gbps(total, ms), verified=_check(sw),
                                host_ms=round(float(np.median(b.host_ms)), 3)))
        except Exception as e:  # noqa: BLE001
            _emit(out, sw, dict(name=name, error=f"{type(e).__name__}: {e}"[:300]))
