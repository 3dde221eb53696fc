"""Kernel-only sweep of the cuda_ipc fragment copy (issue 24): candidate kernels against cudaMemcpyPeer.

One process, two GPUs with peer access (no IPC, no agent): 1 GiB on GPU1 (position-dependent words) is
read as scattered fragments (random slot permutations on both sides, as `transfer_cuda` lays them out) into
1 GiB on GPU0, by each candidate kernel, timed with CUDA events (median of `--reps` launches after one
warm-up). Every launch's whole destination (poisoned first) is compared with an oracle made on GPU0 by a
naive byte-copy kernel from a local copy of the source, so every row is verified.

Candidates (see `variants`; the new kernels' sources are in kernel_sweep_src.py): today's kernel
(agents/cuda_kernels.py's SOURCE, read from the file, launched with the repo's geometry) and string edits of
it (loads in flight per lane `U`, 32-byte lanes, load cache/prefetch hints, threads per CTA, persistent
grids, chunk sizes); `stream`, a uniform-fragment kernel
whose lanes keep U loads in flight across fragment boundaries; `tma`, Hopper's bulk copy engine
(cp.async.bulk peer -> shared -> local, one thread per CTA driving S stages); and `push`, the same copies
launched on the SOURCE GPU (loads local, stores over NVLink). Layouts: `uniform` (every fragment the same
length, 16-byte aligned) and `mis` (lengths flen - [0, 63], each end at a random byte offset: every word
width of `kvb_copy_any` runs).

    python bench/kernel_sweep.py --json out.jsonl [--only sm|tma] [--sizes 4096,16384,65536] [--reps 5]

Needs 2 GPUs with peer access and cupy. Rows: {name, dir, layout, fragment_bytes, gbps, ms, ceiling_gbps,
verified, ...}; a table is printed last.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys

import numpy as np

GIB = 1 << 30
HERE = os.path.dirname(os.path.abspath(__file__))

try:
    from .kernel_sweep_src import ORACLE, STREAM, TMA, V32
except ImportError:  # run as a script (python bench/kernel_sweep.py): bench/ is on sys.path
    from kernel_sweep_src import ORACLE, STREAM, TMA, V32


def repo_source() -> str:
    """agents/cuda_kernels.py's SOURCE, read from the file (no kvbridge import: the GPU image lacks pyzmq)."""
    path = os.path.join(os.path.dirname(HERE), "agents", "cuda_kernels.py")
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SOURCE" for t in node.targets):
            return ast.literal_eval(node.value)
    raise SystemExit(f"no SOURCE in {path}")


def edit(src: str, old: str, new: str) -> str:
    if old not in src:
        raise SystemExit(f"kernel edit failed: {old!r} not in the source")
    return src.replace(old, new)


def sm_source(u: int = 8, load: str = "ld.global", store: str = "st.global", threads: int = 256,
              v32: bool = False, stream_u: int = 0, min_blocks: int = 0) -> str:
    """The repo kernel with the 16-byte path's knobs changed (and the stream kernel appended)."""
    s = repo_source()
    s = edit(s, "copy_words<v16, 8>", f"copy_words<{'v32' if v32 else 'v16'}, {u}>")
    s = edit(s, '"ld.global.v2.u64 {%0, %1}, [%2];"', f'"{load}.v2.u64 {{%0, %1}}, [%2];"')
    s = edit(s, '"st.global.v2.u64 [%0], {%1, %2};"', f'"{store}.v2.u64 [%0], {{%1, %2}};"')
    bounds = f"{threads}, {min_blocks}" if min_blocks else f"{threads}"
    s = s.replace("__launch_bounds__(256)", f"__launch_bounds__({bounds})")
    if v32:
        s = edit(s, "// Copy n bytes s -> d", V32 + "\n// Copy n bytes s -> d")
    if stream_u:
        s += STREAM.replace("SU", str(stream_u)).replace("THREADS_PER_CTA", str(threads))
    return s


# name -> dict(kind, source kwargs, launch kwargs)
def variants() -> list[dict]:
    v = [dict(name="base", src={}),
         dict(name="base_aligned", src={}, fn="kvb_copy_aligned"),
         dict(name="u4", src=dict(u=4)),
         dict(name="u16", src=dict(u=16)),
         dict(name="v32_u4", src=dict(u=4, v32=True)),
         dict(name="v32_u8", src=dict(u=8, v32=True)),
         dict(name="nc", src=dict(load="ld.global.nc")),
         dict(name="nc_noL1", src=dict(load="ld.global.nc.L1::no_allocate")),
         dict(name="L2_128", src=dict(load="ld.global.L2::128B")),
         dict(name="L2_256", src=dict(load="ld.global.L2::256B")),
         dict(name="nc_L2_256", src=dict(load="ld.global.nc.L1::no_allocate.L2::256B")),
         dict(name="u16_nc_L2_256", src=dict(u=16, load="ld.global.nc.L1::no_allocate.L2::256B")),
         dict(name="st_cs", src=dict(store="st.global.cs")),
         dict(name="t128", src=dict(threads=128), threads=128),
         dict(name="t512", src=dict(threads=512), threads=512),
         dict(name="lb3", src=dict(min_blocks=3)),
         dict(name="lb4", src=dict(min_blocks=4)),
         dict(name="u16_lb3", src=dict(u=16, min_blocks=3)),
         dict(name="grid_sm1", src={}, per_sm=1),
         dict(name="grid_sm2", src={}, per_sm=2),
         dict(name="grid_sm4", src={}, per_sm=4),
         dict(name="chunk4k", src={}, chunk=4096),
         dict(name="chunk8k", src={}, chunk=8192),
         dict(name="chunk32k", src={}, chunk=32768),
         dict(name="chunk64k", src={}, chunk=65536),
         dict(name="stream8", src=dict(stream_u=8), fn="kvb_copy_stream", uniform_only=True),
         dict(name="stream16", src=dict(stream_u=16), fn="kvb_copy_stream", uniform_only=True),
         dict(name="stream16_L2_256", src=dict(stream_u=16, load="ld.global.nc.L1::no_allocate.L2::256B"),
              fn="kvb_copy_stream", uniform_only=True),
         dict(name="push_base", src={}, push=True),
         dict(name="push_u16", src=dict(u=16), push=True),
         dict(name="push_stream16", src=dict(stream_u=16), fn="kvb_copy_stream", uniform_only=True, push=True)]
    for x in v:
        x.setdefault("kind", "sm")
    # TMA: (largest piece, stages, CTAs per SM)
    for piece, stages, per_sm in ((16384, 4, 3), (16384, 3, 4), (8192, 6, 4), (4096, 8, 6), (4096, 12, 4),
                                  (32768, 3, 2)):
        v.append(dict(name=f"tma_p{piece // 1024}k_s{stages}_c{per_sm}", kind="tma", piece=piece,
                      stages=stages, per_sm=per_sm, uniform_only=True))
    for piece, stages, per_sm in ((16384, 4, 3), (4096, 8, 6)):
        v.append(dict(name=f"push_tma_p{piece // 1024}k_s{stages}_c{per_sm}", kind="tma", piece=piece,
                      stages=stages, per_sm=per_sm, uniform_only=True, push=True))
    return v


class Sweep:
    def __init__(self, total: int, reps: int, out) -> None:
        import cupy as cp

        self.cp, self.total, self.reps, self.out = cp, total, reps, out
        cp.cuda.Device(0).use()
        for a, b in ((0, 1), (1, 0)):
            with cp.cuda.Device(a):
                if not cp.cuda.runtime.deviceCanAccessPeer(a, b):
                    raise SystemExit(f"GPU{a} cannot access GPU{b}")
                cp.cuda.runtime.deviceEnablePeerAccess(b)
        self.props = cp.cuda.runtime.getDeviceProperties(0)
        self.sms = int(self.props["multiProcessorCount"])
        with cp.cuda.Device(1):
            w = cp.arange(total // 8, dtype=cp.int64)
            self.src = (w * 0x9E3779B1 + (3 << 40) + 0x5DEECE66D).view(cp.uint8)
            del w
            self.s1 = cp.cuda.Stream(non_blocking=True)
        self.srcl = cp.empty(total, dtype=cp.uint8)
        cp.cuda.runtime.memcpyPeer(self.srcl.data.ptr, 0, self.src.data.ptr, 1, total)
        self.dst = cp.empty(total, dtype=cp.uint8)
        self.expect = cp.empty(total, dtype=cp.uint8)
        self.s0 = cp.cuda.Stream(non_blocking=True)
        self.oracle = cp.RawKernel(ORACLE, "oracle")
        self.modules: dict = {}
        self.ceiling = self.memcpy_peer()
        self.layout = None

    # --- layouts -------------------------------------------------------------------------------------
    def set_layout(self, flen: int, layout: str) -> None:
        cp, total = self.cp, self.total
        rng = np.random.default_rng(flen * 7 + (layout == "mis"))
        n = total // flen
        ps, pd = rng.permutation(n).astype(np.int64), rng.permutation(n).astype(np.int64)
        if layout == "uniform":
            lens = np.full(n, flen, dtype=np.int64)
            soff = doff = np.zeros(n, dtype=np.int64)
        else:  # shorter lengths and random byte offsets inside each slot: every word width runs
            lens = flen - rng.integers(0, 64, size=n).astype(np.int64)
            soff = rng.integers(0, flen - lens + 1)
            doff = rng.integers(0, flen - lens + 1)
        cum = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lens, out=cum[1:])
        sa = self.src.data.ptr + ps * flen + soff
        da = self.dst.data.ptr + pd * flen + doff
        ea = self.expect.data.ptr + pd * flen + doff
        self.n, self.flen, self.layout_name = n, flen, layout
        self.sa, self.da, self.lens = sa, da, lens
        self.moved = int(cum[-1])
        self.uniform = flen if layout == "uniform" else 0
        host = np.concatenate([sa, da, cum])
        with cp.cuda.Device(0):
            self.table0 = cp.asarray(host)
        with cp.cuda.Device(1):
            self.table1 = cp.asarray(host)
        # the oracle: poisoned buffer, naive byte copies from the local source copy
        sl = self.srcl.data.ptr + ps * flen + soff
        with cp.cuda.Device(0):
            self.expect.fill(0xA5)
            otab = cp.asarray(np.concatenate([sl, ea, cum]))
            self.oracle((n,), (256,), (otab, np.int64(n)))
            cp.cuda.Device(0).synchronize()

    # --- timing --------------------------------------------------------------------------------------
    def _time(self, launch, dev: int, stream) -> list[float]:
        cp = self.cp
        with cp.cuda.Device(dev):
            launch()
            stream.synchronize()
            ms = []
            for _ in range(self.reps):
                a, b = cp.cuda.Event(), cp.cuda.Event()
                a.record(stream)
                launch()
                b.record(stream)
                b.synchronize()
                ms.append(cp.cuda.get_elapsed_time(a, b))
        return ms

    def memcpy_peer(self) -> float:
        cp = self.cp
        s = self.s0

        def go():
            cp.cuda.runtime.memcpyPeerAsync(self.dst.data.ptr, 0, self.src.data.ptr, 1, self.total, s.ptr)

        ms = self._time(go, 0, s)
        return self.total / (float(np.median(ms)) * 1e-3) / 1e9

    def module(self, v: dict, dev: int):
        cp = self.cp
        key = (v["kind"], json.dumps(v.get("src", {}), sort_keys=True), v.get("stages"), dev)
        if key not in self.modules:
            with cp.cuda.Device(dev):
                if v["kind"] == "tma":
                    code = TMA.replace("TMA_S", str(v["stages"]))
                else:
                    code = sm_source(**v.get("src", {}))
                mod = cp.RawModule(code=code, options=("-std=c++17", "-default-device"), backend="nvrtc")
                fn = mod.get_function("kvb_copy_tma" if v["kind"] == "tma" else v.get("fn", "kvb_copy_any"))
                if hasattr(fn, "compile"):
                    fn.compile()
                self.modules[key] = (mod, fn)
        return self.modules[key][1]

    def occupancy(self, fn, threads: int, smem: int) -> int:
        try:
            from cuda.bindings import driver
            err, k = driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(driver.CUfunction(fn.kernel.ptr), threads, smem)
            if int(err) == 0:
                return int(k)
        except Exception:  # noqa: BLE001, S110 - no cuda-bindings: estimate from registers below
            pass
        regs = max(8, -(-fn.num_regs // 8) * 8)
        return max(1, min(2048 // threads, 65536 // (regs * threads), 32))

    def run(self, v: dict) -> dict | None:
        cp = self.cp
        if v.get("uniform_only") and not self.uniform:
            return None
        dev = 1 if v.get("push") else 0
        stream = self.s1 if dev else self.s0
        table = self.table1 if dev else self.table0
        row = dict(name=v["name"], dir="push" if dev else "pull", layout=self.layout_name,
                   fragment_bytes=self.flen, fragments=self.n, bytes=self.moved)
        try:
            fn = self.module(v, dev)
            row["regs"] = fn.num_regs
            n = np.int64(self.n)
            if v["kind"] == "tma":
                piece = min(self.flen, v["piece"])
                smem = v["stages"] * piece
                with cp.cuda.Device(dev):
                    fn.max_dynamic_shared_size_bytes = smem
                blocks = self.sms * v["per_sm"]
                args = (table, n, np.int64(piece), np.int64(self.flen // piece), np.int64(self.flen))

                def launch():
                    with stream:
                        fn((blocks,), (32,), args, shared_mem=smem)
                row.update(piece=piece, blocks=blocks, smem=smem)
            else:
                threads = v.get("threads", 256)
                per_sm = v.get("per_sm") or self.occupancy(fn, threads, 0)
                cap = per_sm * self.sms
                wpc = threads // 32
                chunk = v.get("chunk")
                if chunk is None:  # the repo's geometry (FragmentCopier.geometry)
                    want = -(-self.moved // (cap * wpc * 4))
                    chunk = min(16 << 10, max(1 << 10, -(-want // 512) * 512))
                nchunks = -(-self.moved // chunk)
                blocks = max(1, min(cap, -(-nchunks // wpc)))
                args = (table, n, np.int64(chunk), np.int64(nchunks), np.int64(self.uniform))

                def launch():
                    with stream:
                        fn((blocks,), (threads,), args)
                row.update(threads=threads, per_sm=per_sm, blocks=blocks, chunk=chunk)
            with cp.cuda.Device(0):
                self.dst.fill(0xA5)
                cp.cuda.Device(0).synchronize()
            ms = self._time(launch, dev, stream)
            with cp.cuda.Device(0):
                row["verified"] = bool(cp.array_equal(self.dst, self.expect))
            med = float(np.median(ms))
            row.update(ms=round(med, 4), gbps=round(self.moved / (med * 1e-3) / 1e9, 1),
                       best_gbps=round(self.moved / (min(ms) * 1e-3) / 1e9, 1),
                       ceiling_gbps=round(self.ceiling, 1))
        except Exception as e:  # noqa: BLE001 - one variant's failure is a row, not the end of the sweep
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        print(json.dumps(row), file=self.out, flush=True)
        return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="-", help="rows as JSON lines (appended)")
    ap.add_argument("--sizes", default="4096,16384,65536")
    ap.add_argument("--layouts", default="uniform,mis")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--total-mib", type=int, default=1024)
    ap.add_argument("--only", default="", help="sm | tma | extras | comma-separated variant names")
    ap.add_argument("--skip", default="", help="comma-separated variant names not to run")
    ap.add_argument("--mis-variants", default="base,u4,u16,v32_u4,nc,L2_256,nc_L2_256,lb3,lb4,t512,chunk32k,push_base",
                    help="variants also run on the misaligned layout")
    a = ap.parse_args(argv)
    out = sys.stdout if a.json == "-" else open(a.json, "a")  # noqa: SIM115 - lives as long as the run
    vs = variants()
    if a.only in ("sm", "tma"):
        vs = [v for v in vs if v["kind"] == a.only]
    elif a.only:
        names = set(a.only.split(","))
        vs = [v for v in vs if v["name"] in names]
    vs = [v for v in vs if v["name"] not in set(a.skip.split(","))]
    mis = set(a.mis_variants.split(","))
    if a.only == "extras":  # the copy engine on scattered fragments, alone and beside the kernel
        try:
            from .kernel_sweep_ce import extras
        except ImportError:  # run as a script (python bench/kernel_sweep.py): bench/ is on sys.path
            from kernel_sweep_ce import extras
        sw = Sweep(a.total_mib << 20, a.reps, out)
        for size in (int(s) for s in a.sizes.split(",")):
            sw.set_layout(size, "uniform")
            extras(sw, out)
        return 0
    sw = Sweep(a.total_mib << 20, a.reps, out)
    print(f"# {sw.props['name'].decode() if isinstance(sw.props['name'], bytes) else sw.props['name']}, "
          f"{sw.sms} SMs, memcpyPeer 1 GiB {sw.ceiling:.1f} GB/s", flush=True)
    rows = []
    for layout in a.layouts.split(","):
        for size in (int(s) for s in a.sizes.split(",")):
            sw.set_layout(size, layout)
            ceiling = sw.memcpy_peer()
            print(json.dumps(dict(name="memcpy_peer_1GiB", layout=layout, fragment_bytes=size,
                                  gbps=round(ceiling, 1))), file=out, flush=True)
            for v in vs:
                if layout == "mis" and v["name"] not in mis:
                    continue
                r = sw.run(v)
                if r is not None:
                    rows.append(r)
    base = {(r["layout"], r["fragment_bytes"]): r.get("gbps") for r in rows if r["name"] == "base"}
    print(f"{'variant':24} {'dir':4} {'layout':7} {'frag':>6} {'GB/s':>7} {'vs base':>8} ok")
    for r in rows:
        b = base.get((r["layout"], r["fragment_bytes"]))
        g = r.get("gbps")
        rel = f"{g / b:8.3f}" if g and b else " " * 8
        print(f"{r['name']:24} {r['dir']:4} {r['layout']:7} {r['fragment_bytes']:6} "
              f"{g if g is not None else 'ERR':>7} {rel} {r.get('verified', r.get('error', '')[:60])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
