"""Two halves of one 1 GiB read at once, in one process: which GPU runs each copy kernel, and what the link gives.

Why: TP1 -> TP2 on two GPUs puts both generation ranks (two processes) on GPU0, reading their halves from GPU1.
Their kernels take turns on the shared GPU (~300 GB/s for the request); with `launch_on="peer"` one of them runs
on GPU1 instead, and both copy at once (~313). This measures the halves' combinations without processes or the
transceiver in the way: cuda_ipc agents of one process (the exporter's memory on GPU1, the readers' on GPU0),
each variant posting its halves' READs back to back and waiting for all, 512 MiB a half in `--frag`-byte
fragments scattered on both sides. Variants: a half alone pulled (kernel on GPU0) or pushed (kernel on GPU1);
both halves pulled at once (two agents: two streams on GPU0, one process, so no turn-taking); one pulled and
one pushed, the pushed one at full occupancy or capped (`max_blocks`); both pushed. GB/s = bytes / (first post
-> last end), median of `--reps` after a warm-up; every variant's destination is poisoned first and compared
whole with the expected bytes.

    python -m kvbridge.bench.launch_mix [--frag 16384] [--reps 5] [--json P]

Needs 2 GPUs with peer access (torch with CUDA).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

HALF = 512 << 20


def main(argv: list[str] | None = None) -> int:
    import torch

    from kvbridge.agents import DescriptorList, MemoryKind, MemoryRegion, create_agent

    ap = argparse.ArgumentParser(prog="kvbridge.bench.launch_mix", description=__doc__.split("\n\n")[0])
    ap.add_argument("--frag", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", help="append the rows here (JSON lines)")
    args = ap.parse_args(argv)
    frag, n = args.frag, HALF // args.frag
    words = torch.arange(2 * HALF // 8, dtype=torch.int64, device="cuda:1") * 0x9E3779B1 + (5 << 40)
    src = words.view(torch.uint8)
    dst = torch.empty(2 * HALF, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    exporter = create_agent("cuda_ipc", "mix-src")
    regs = [exporter.register_memory(MemoryRegion.of(src))]
    readers = {}
    for name, opts in (("pull", {}), ("pull2", {}), ("push", {"launch_on": "peer"}),
                       ("push2", {"launch_on": "peer"}), ("push_mb66", {"launch_on": "peer", "max_blocks": 66}),
                       ("push_mb132", {"launch_on": "peer", "max_blocks": 132})):
        a = create_agent("cuda_ipc", f"mix-{name}", **opts)
        regs.append(a.register_memory(MemoryRegion.of(dst)))
        readers[name] = (a, a.connect(exporter.metadata()))
    rng = np.random.default_rng(0)
    # half h: fragments of src's half h (random order) to random slots of dst's half h
    s_idx = [h * n + rng.permutation(n) for h in (0, 1)]
    d_idx = [h * n + rng.permutation(n) for h in (0, 1)]
    lens = np.full(n, frag, dtype=np.int64)
    want = torch.empty_like(dst).view(-1, frag)
    src0 = src.to("cuda:0").view(-1, frag)
    for h in (0, 1):
        want[torch.from_numpy(d_idx[h]).to("cuda:0")] = src0[torch.from_numpy(s_idx[h]).to("cuda:0")]
    del src0
    variants = {"pull alone": [("pull", 0)], "push alone": [("push", 1)], "pull + pull": [("pull", 0), ("pull2", 1)],
                "pull + push": [("pull", 0), ("push", 1)], "pull + push (66 CTAs)": [("pull", 0), ("push_mb66", 1)],
                "pull + push (132 CTAs)": [("pull", 0), ("push_mb132", 1)], "push + push": [("push", 0), ("push2", 1)]}
    rows = []
    for label, parts in variants.items():
        times, ok = [], True
        for rep in range(args.reps + 1):
            dst.fill_(0xAB)
            torch.cuda.synchronize(0)
            t0 = time.perf_counter()
            hs = [readers[r][0].read(readers[r][1],
                                     DescriptorList(dst.data_ptr() + d_idx[h] * frag, lens, MemoryKind.VRAM, 0),
                                     DescriptorList(src.data_ptr() + s_idx[h] * frag, lens, MemoryKind.VRAM, 1))
                  for r, h in parts]
            for hd in hs:
                hd.wait(30.0)
            dt = time.perf_counter() - t0
            for hd in hs:
                hd.release()
            if rep:
                times.append(dt)
            halves = [h for _, h in parts]
            got = dst.view(2, -1)
            ok = ok and all(torch.equal(got[h], want.view(2, -1)[h]) for h in halves)
            ok = ok and all(bool((got[h] == 0xAB).all()) for h in (0, 1) if h not in halves)
        ms = statistics.median(times) * 1e3
        row = {"variant": label, "fragment_bytes": frag, "bytes": HALF * len(parts), "ms": round(ms, 3),
               "gbps": round(HALF * len(parts) / ms / 1e6, 1), "all_ms": [round(t * 1e3, 3) for t in times],
               "verified": ok}
        rows.append(row)
        print(f"{label:24s} {row['gbps']:7.1f} GB/s  {ms:.3f} ms  verified={ok}", flush=True)
    for r in regs:
        r.release()
    for a, _ in readers.values():
        a.close()
    exporter.close()
    if args.json:
        with open(args.json, "a", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0 if all(r["verified"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
