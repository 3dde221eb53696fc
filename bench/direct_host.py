"""The direct path's host work on CPU: planning and the cuda_ipc agent's posts for the GPU benchmarks' shapes,
with the CUDA driver replaced by a stub (bench/cuda_stub.py), so it runs without a GPU.

What it times is what the generation rank's I/O thread (or the caller of one READ) does before and between
kernels; the copies themselves are not run (the stub records each launch and its time). Two shapes:

- transceiver: one 1 GiB request of bench/direct_gpu.py (Llama-8B-shaped KV, 8,192 tokens, 16 tokens per block,
  520-block pools, scattered block ids drawn anew per request), ctx TP2 -> gen TP1 (two legs on one rank) and
  ctx TP1 -> gen TP2 (one leg on each rank); per leg: `plan_piece` (plan_ms), DescriptorLists + `agent.read`
  (post_ms); first_launch_ms = from the start of the first leg's planning to its kernel launch.
- read: one READ of 1 GiB in 4 KiB / 16 KiB / 64 KiB / 1 GiB fragments as bench/transfer_cuda.py posts it
  (scattered offsets, DescriptorLists built inside the timing): post_ms = until `read` returned,
  first_launch_ms = until the first kernel was launched, and the launches' count. transfer_cuda's post_ms for
  the same case on a GPU host minus this figure on that host is what the real CUDA calls cost there.

Figures are medians over `--requests` after two warm-ups (best_*: the fastest request, the figure least
disturbed by other work on a shared machine). `--fresh-pages` runs the same in a child process
with MALLOC_MMAP_THRESHOLD_=131072 (every large numpy array is new memory, its pages faulted on first touch),
which reproduces the planning times seen in the GPU runs; the default keeps glibc's adaptive threshold.
`driver_calls` counts stub driver calls per post. Runs against whichever kvbridge is importable (absolute
imports only), so one script measures two trees:

    python bench/direct_host.py [--requests 30] [--fresh-pages] [--json P]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

TOKENS, NB, TPB, GIB = 8192, 520, 16, 1 << 30


def _stub_module():
    spec = importlib.util.spec_from_file_location("kvb_cuda_stub", Path(__file__).with_name("cuda_stub.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _layout(tp: int):
    from kvbridge.formatter.layout import KVLayout, KVShape, ParallelSplit

    return KVLayout(KVShape(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", tokens_per_block=TPB),
                    ParallelSplit(tp=tp))


class _Pair:
    """A local agent on device 0 and one peer agent per remote pool on device 1 (as one per context rank),
    connected both ways; one process, so the stub's IPC is the identity."""

    def __init__(self, stub, local_bytes: list[int], remote_bytes: list[int]) -> None:
        from kvbridge.agents import MemoryKind, MemoryRegion, create_agent

        self.local = create_agent("cuda_ipc", "host-local")
        self.remotes = [create_agent("cuda_ipc", f"host-peer{i}") for i in range(len(remote_bytes))]
        self.lbases = [stub.device_range(n, 0) for n in local_bytes]
        self.rbases = [stub.device_range(n, 1) for n in remote_bytes]
        self.regs = [self.local.register_memory(MemoryRegion(b, n, MemoryKind.VRAM, 0))
                     for b, n in zip(self.lbases, local_bytes)]
        self.regs += [a.register_memory(MemoryRegion(b, n, MemoryKind.VRAM, 1))
                      for a, b, n in zip(self.remotes, self.rbases, remote_bytes)]
        self.peers = [self.local.connect(a.metadata()) for a in self.remotes]
        for a in self.remotes:
            a.connect(self.local.metadata())

    def close(self) -> None:
        for r in self.regs:
            r.release()
        for a in [self.local, *self.remotes]:
            a.close()


def _post_leg(pair, i: int, frags):
    from kvbridge.agents import DescriptorList, MemoryKind

    if not hasattr(frags, "src"):  # a GridPlan (trees that have them)
        from kvbridge.agents import DescriptorGrid

        return pair.local.read_grid(pair.peers[i],
                                    DescriptorGrid(frags.dst_outer, frags.dst_inner, frags.length, MemoryKind.VRAM, 0),
                                    DescriptorGrid(frags.src_outer, frags.src_inner, frags.length, MemoryKind.VRAM, 1))
    return pair.local.read(pair.peers[i], DescriptorList(frags.dst, frags.length, MemoryKind.VRAM, 0),
                           DescriptorList(frags.src, frags.length, MemoryKind.VRAM, 1))


def _planner(agent):
    """The receiver's planning in this tree: a grid for agents that take grids, else fragments from reused
    memory (PlanScratch) where the tree has them, else fresh fragments."""
    from kvbridge.formatter import planner

    if getattr(agent, "grid_native", False) and hasattr(planner, "plan_grid"):
        def plan(p, ctx, gen, cb, gb, n):
            return planner.plan_grid(p, ctx, gen, cb, gb, n) or planner.plan_piece(p, ctx, gen, cb, gb, n)
        return plan, None
    if hasattr(planner, "PlanScratch"):
        scratch = planner.PlanScratch()
        return (lambda p, ctx, gen, cb, gb, n: planner.plan_piece(p, ctx, gen, cb, gb, n, scratch=scratch)), scratch
    return planner.plan_piece, None


def transceiver_case(stub, ctx_tp: int, gen_tp: int, requests: int) -> list[dict]:
    """Per generation rank: plan and post of each leg of a 1 GiB request, as the receiver does them."""
    from kvbridge.formatter.mapping import mapping_for
    from kvbridge.formatter.planner import RankPool
    from kvbridge.agents import MemoryKind

    cl, gl = _layout(ctx_tp), _layout(gen_tp)
    rows = []
    for g in range(gen_tp):
        pieces = mapping_for(cl, gl).pieces(g)
        pair = _Pair(stub, [gl.block_bytes(g) * NB], [cl.block_bytes(p.ctx_rank) * NB for p in pieces])
        gen = RankPool.of(gl, g, pair.lbases, NB, MemoryKind.VRAM, 0)
        ctx = {p.ctx_rank: RankPool.of(cl, p.ctx_rank, [pair.rbases[i]], NB, MemoryKind.VRAM, 1)
               for i, p in enumerate(pieces)}
        plan_fn, scratch = _planner(pair.local)
        rng = np.random.default_rng(g)
        samples = []
        for rid in range(requests + 2):
            cb, gb = rng.permutation(NB)[:TOKENS // TPB], rng.permutation(NB)[:TOKENS // TPB]
            stub.launches.clear()
            calls0 = sum(stub.calls.values())
            start = time.perf_counter()
            plan = post = 0.0
            handles, plans = [], []
            for i, p in enumerate(pieces):
                t0 = time.perf_counter()
                frags = plan_fn(p, ctx[p.ctx_rank], gen, cb, gb, TOKENS)
                plans.append(getattr(frags, "src", None))
                t1 = time.perf_counter()
                handles.append(_post_leg(pair, i, frags))
                post += time.perf_counter() - t1
                plan += t1 - t0
            first = stub.launches[0].at - start
            calls = sum(stub.calls.values()) - calls0
            for h in handles:
                h.wait(5.0)
                h.release()
            for arr in plans if scratch is not None else ():
                scratch.give(arr)
            if rid >= 2:
                samples.append((plan, post, first, calls))
        pair.close()
        a = np.array(samples)
        med, best = np.median(a, axis=0), a.min(axis=0)
        rows.append({"case": f"ctx TP{ctx_tp} -> gen TP{gen_tp}", "gen_rank": g, "legs": len(pieces),
                     "fragments": len(frags) * len(pieces), "plan_ms": round(med[0] * 1e3, 3),
                     "post_ms": round(med[1] * 1e3, 3), "plan_post_ms": round((med[0] + med[1]) * 1e3, 3),
                     "first_launch_ms": round(med[2] * 1e3, 3), "driver_calls": int(med[3]),
                     "best_plan_post_ms": round((a[:, 0] + a[:, 1]).min() * 1e3, 3),
                     "best_first_launch_ms": round(best[2] * 1e3, 3)})
    return rows


def read_case(stub, frag: int, requests: int) -> dict:
    """One READ of 1 GiB in `frag`-byte fragments, as bench/transfer_cuda.py times it."""
    from kvbridge.agents import DescriptorList, MemoryKind

    pair = _Pair(stub, [GIB], [GIB])
    rng = np.random.default_rng(0)
    n = GIB // frag
    local = pair.lbases[0] + rng.permutation(n).astype(np.int64) * frag
    remote = pair.rbases[0] + rng.permutation(n).astype(np.int64) * frag
    lens = np.full(n, frag, dtype=np.int64)
    samples = []
    for rep in range(requests + 2):
        stub.launches.clear()
        t0 = time.perf_counter()
        h = pair.local.read(pair.peers[0], DescriptorList(local, lens, MemoryKind.VRAM, 0),
                            DescriptorList(remote, lens, MemoryKind.VRAM, 1))
        post = time.perf_counter() - t0
        first = stub.launches[0].at - t0
        kernels = len(stub.launches)
        h.wait(5.0)
        h.release()
        if rep >= 2:
            samples.append((post, first))
    pair.close()
    a = np.array(samples)
    med, best = np.median(a, axis=0), a.min(axis=0)
    return {"case": f"one READ, {frag >> 10} KiB x {n}", "fragment_bytes": frag, "fragments": n, "kernels": kernels,
            "post_ms": round(med[0] * 1e3, 3), "first_launch_ms": round(med[1] * 1e3, 3),
            "best_post_ms": round(best[0] * 1e3, 3), "best_first_launch_ms": round(best[1] * 1e3, 3)}


def run(requests: int) -> list[dict]:
    stub_mod = _stub_module()
    with stub_mod.installed() as stub:
        stub.record_tables = False
        rows = transceiver_case(stub, 2, 1, requests) + transceiver_case(stub, 1, 2, requests)
        rows += [read_case(stub, f, max(5, requests // 3)) for f in (4 << 10, 16 << 10, 64 << 10, GIB)]
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/direct_host.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--fresh-pages", action="store_true", help="malloc hands out new pages for large arrays")
    ap.add_argument("--json", help="append the rows here (JSON lines)")
    ap.add_argument("--label", default="", help="a name for this tree in the rows")
    args = ap.parse_args(argv)
    if args.fresh_pages and os.environ.get("MALLOC_MMAP_THRESHOLD_") != "131072":
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
        return subprocess.call([sys.executable, __file__, *(argv if argv is not None else sys.argv[1:])], env=env)
    import kvbridge

    pages = "fresh" if os.environ.get("MALLOC_MMAP_THRESHOLD_") == "131072" else "default"
    rows = run(args.requests)
    for r in rows:
        r.update(pages=pages, tree=args.label or os.path.dirname(kvbridge.__file__), python=platform.python_version(),
                 numpy=np.__version__)
        print(f"{r['case']:<34} {('rank %d' % r['gen_rank']) if 'gen_rank' in r else '':<7} "
              + "  ".join(f"{k}={r[k]}" for k in ("plan_ms", "post_ms", "plan_post_ms", "first_launch_ms",
                                                   "driver_calls", "kernels", "best_plan_post_ms",
                                                   "best_post_ms", "best_first_launch_ms") if k in r)
              + f"  pages={pages}")
    if args.json:
        with open(args.json, "a", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
