"""Where one cuda_ipc READ's time goes: host post, upload, each pipelined kernel, the gaps, completion.

Times one READ of 1 GiB (GPU1 -> GPU0, two processes, scattered fragments, as `transfer_cuda` does: the
DescriptorLists are built inside the timing) and places every piece on one clock. A reference CUDA event is
recorded on an idle stream just before the host clock starts, so GPU events (each part's upload start, a
timing event enqueued just before each kernel, the part's completion event) read as microseconds since t0;
the host side records when `read` returned, when each kernel launch was called and when `wait` returned.
`detect` is wall time from the last kernel's end to `wait` returning. A second pass wraps the driver
functions to price each call on this host. Every READ's destination is compared byte for byte.

    python -m kvbridge.bench.read_timeline --sizes 1073741824,65536,16384 --reps 10 --json out.json

Needs 2 GPUs, torch with CUDA and cuda-bindings. Runs against whichever kvbridge is importable.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
from kvbridge.bench.transfer_cuda import (
    GIB,
    SEED,
    TIMEOUT,
    Case,
    PeerProcess,
    _connect_agents,
    _enable_peer_access,
    _reset,
    _verify,
    gpu_pattern,
)


class _Timeline:
    """Timing events before each kernel launch of one agent (wraps its engine's copier)."""

    def __init__(self, agent, cu, drv) -> None:
        self.cu, self.drv = cu, drv
        self.engine = agent._engine(0)
        self.copier = self.engine.copier
        self.pre: list = []
        self.launch_at: list[float] = []
        self._pool: list = []
        orig = type(self.copier).launch

        def launch(copier, table, n, total, aligned, stream, **kw):
            k = len(self.launch_at)
            while len(self._pool) <= k:
                self._pool.append(drv.check(cu.cuEventCreate(0), "cuEventCreate"))
            self.launch_at.append(time.perf_counter())
            with self.engine.dev.current():
                drv.check(cu.cuEventRecord(self._pool[k], stream), "cuEventRecord")
            self.pre.append(self._pool[k])
            return orig(copier, table, n, total, aligned, stream, **kw)

        self.copier.launch = launch.__get__(self.copier)
        with self.engine.dev.current():
            self.ref = drv.check(cu.cuEventCreate(0), "cuEventCreate")
            self.ref_stream = drv.check(cu.cuStreamCreate(1), "cuStreamCreate")

    def reset(self) -> None:
        self.pre, self.launch_at = [], []

    def mark(self) -> float:
        with self.engine.dev.current():
            self.drv.check(self.cu.cuEventRecord(self.ref, self.ref_stream), "cuEventRecord")
        return time.perf_counter()

    def since_ref(self, ev) -> float:
        with self.engine.dev.current():
            return float(self.drv.check(self.cu.cuEventElapsedTime(self.ref, ev), "cuEventElapsedTime")) * 1e3


def _slots(h) -> list:
    parts = getattr(h, "_parts", None) or [h]
    return [p._slot for p in parts]


def time_read(agent, peer: str, dst, remote_addr: int, case: Case, reps: int, tl: _Timeline, mode: str):
    from kvbridge.agents import DescriptorList, MemoryKind

    case.addresses(dst.data_ptr(), remote_addr)
    rows, ok = [], True
    for rep in range(reps + 1):
        _reset(dst)
        tl.reset()
        t0 = tl.mark()
        loc = DescriptorList(case.local_addrs, case.lens, MemoryKind.VRAM, 0)
        rem = DescriptorList(case.remote_addrs, case.lens, MemoryKind.VRAM, 1)
        t1 = time.perf_counter()
        h = agent.read(peer, loc, rem)
        t2 = time.perf_counter()
        slots = _slots(h)
        if mode == "spin":
            deadline = t2 + TIMEOUT
            while h.state().value == "PENDING" and time.perf_counter() < deadline:
                pass
            h.wait(TIMEOUT)
        else:
            h.wait(TIMEOUT)
        t3 = time.perf_counter()
        up = [tl.since_ref(s.start) for s in slots if s.start is not None]
        ends = [tl.since_ref(s.event) for s in slots]
        pre = [tl.since_ref(e) for e in tl.pre]
        h.release()
        ok &= _verify(dst, case)
        if rep == 0:
            continue
        def us(t: float, t0: float = t0) -> float:
            return (t - t0) * 1e6

        rows.append(dict(wall=us(t3), lists=us(t1), post=us(t2), launch_calls=[round(us(t), 1) for t in tl.launch_at],
                         upload_start=[round(x, 1) for x in up], kernel_start=[round(x, 1) for x in pre],
                         kernel_end=[round(x, 1) for x in ends], detect=us(t3) - ends[-1],
                         gaps=[round(pre[k + 1] - ends[k], 1) for k in range(len(ends) - 1)],
                         kernels_us=round(sum(e - s for s, e in zip(pre, ends)), 1)))
    return rows, ok


def price_calls(agent, peer, dst, remote_addr, case, reps, cu) -> dict:
    """Per driver call: count and mean microseconds per READ (the functions wrapped for this pass only)."""
    names = ["cuCtxPushCurrent", "cuCtxPopCurrent", "cuEventRecord", "cuMemcpyHtoDAsync", "cuStreamWaitEvent",
             "cuLaunchKernel", "cuEventQuery", "cuEventElapsedTime"]
    acc = {n: [0, 0.0] for n in names}
    saved = {n: getattr(cu, n) for n in names}

    def wrap(n, f):
        def g(*a):
            t = time.perf_counter()
            r = f(*a)
            acc[n][1] += time.perf_counter() - t
            acc[n][0] += 1
            return r
        return g

    from kvbridge.agents import DescriptorList, MemoryKind

    case.addresses(dst.data_ptr(), remote_addr)
    try:
        for n in names:
            setattr(cu, n, wrap(n, saved[n]))
        for _ in range(reps):
            h = agent.read(peer, DescriptorList(case.local_addrs, case.lens, MemoryKind.VRAM, 0),
                           DescriptorList(case.remote_addrs, case.lens, MemoryKind.VRAM, 1))
            h.wait(TIMEOUT)
            h.release()
    finally:
        for n in names:
            setattr(cu, n, saved[n])
    return {n: dict(calls=round(c / reps, 1), us_each=round(s / max(c, 1) * 1e6, 2)) for n, (c, s) in acc.items()}


def host_clock() -> dict:
    """What sleeping and spinning cost on this host's CPU (microseconds)."""
    out = {}
    for want in (0.0, 50e-6, 2e-3):
        xs = []
        for _ in range(200 if want < 1e-3 else 20):
            t = time.perf_counter()
            time.sleep(want)
            xs.append((time.perf_counter() - t - want) * 1e6)
        out[f"sleep({want * 1e6:g} us) overshoot"] = round(float(np.median(xs)), 1)
    return out


def _med(rows: list[dict], key: str):
    v = [r[key] for r in rows]
    if isinstance(v[0], list):
        return [round(float(np.median([x[i] for x in v if len(x) > i])), 1) for i in range(len(v[0]))]
    return round(float(np.median(v)), 1)


def main(argv=None) -> int:
    import torch
    from kvbridge.agents import cuda_driver as drv

    p = argparse.ArgumentParser(prog="kvbridge.bench.read_timeline", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=f"{GIB},65536,16384")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--mode", choices=["wait", "spin"], default="wait")
    p.add_argument("--label", default="")
    p.add_argument("--json")
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    torch.cuda.set_device(0)
    _enable_peer_access(0, 1)
    peer_proc = PeerProcess(GIB, ["cuda_ipc"])
    live, out = [], {"label": args.label, "mode": args.mode, "host": host_clock(), "sizes": {}}
    ok_all = True
    try:
        dst = torch.empty(GIB, dtype=torch.uint8, device="cuda:0")
        pattern0 = gpu_pattern(GIB, "cuda:0", SEED).clone()
        torch.cuda.synchronize()
        agent, name = _connect_agents(["cuda_ipc"], {}, dst, peer_proc, live)["cuda_ipc"]
        cu, _ = drv.load()
        tl = _Timeline(agent, cu, drv)
        rng = np.random.default_rng(0)
        for frag in sizes:
            case = Case(frag, GIB, pattern0, rng)
            rows, ok = time_read(agent, name, dst, peer_proc.addr, case, args.reps, tl, args.mode)
            ok_all &= ok
            calls = price_calls(agent, name, dst, peer_proc.addr, case, 5, cu)
            best = min(r["wall"] for r in rows)
            s = {k: _med(rows, k) for k in ("wall", "lists", "post", "launch_calls", "upload_start",
                                              "kernel_start", "kernel_end", "gaps", "detect", "kernels_us")}
            s.update(best_gbps=round(GIB / best / 1e3, 1), median_gbps=round(GIB / s["wall"] / 1e3, 1),
                     verified=ok, calls=calls, rows=rows)
            out["sizes"][frag] = s
            print(f"{args.label} {frag >> 10} KiB x {case.n}: wall {s['wall']} us (best {s['best_gbps']} GB/s) "
                  f"lists {s['lists']} post {s['post']} launches@{s['launch_calls']} up@{s['upload_start']} "
                  f"k@{s['kernel_start']} end@{s['kernel_end']} gaps {s['gaps']} kernels {s['kernels_us']} "
                  f"detect {s['detect']} verified={ok}", flush=True)
            print("   calls/READ: " + ", ".join(f"{n} {c['calls']}x{c['us_each']}" for n, c in calls.items()),
                  flush=True)
            del case
    finally:
        for a, reg in live:
            reg.release()
            a.close()
        peer_proc.close()
    print(f"{args.label} host: {out['host']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
