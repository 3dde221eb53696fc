"""One cuda_ipc READ end to end, pipelined parts of equal size against parts that grow, in ONE process.

The host's speed differs from process to process on the lent GPU hosts (post_ms of one 1 GiB fragment
0.13-0.28 ms between runs of the same tree), more than the changes measured here, so an A/B across runs
of `transfer_cuda` says little. Here the modes alternate READ by READ in one process, on one agent:
  equal      a first part of post_chunk / 8 descriptors, then post_chunk each (main before issue 24's read8);
  grow       parts doubling from post_chunk / 8 up to post_chunk (`chunk_bounds(..., grow=True)`);
  auto       the class's default (post_grow=None): grow where the first fragments average under 16 KiB, so
             the same code as one of the two above at every size (their spread is this run's noise).
or (read9, `--modes checked,fused`) where a list's ranges are checked, each with the class's own part sizes:
  checked    both DescriptorLists validated as they are built (`validate()`: main's cost before read9, two
             passes over each list), then read;
  fused      read at once: cuda_ipc checks each part's ranges in the passes its staging makes (`checks_ranges`).
Timing as `transfer_cuda`: DescriptorLists built inside the timing, `wait` returns, then the whole 1 GiB
destination is compared with the expected bytes (every READ verified). (read7's modes, base / nopipe / new,
compared the completion and posting changes of that session; they are in its commit.)

    python -m kvbridge.bench.read_ab --sizes 4096,16384,65536,1073741824 --reps 20 --json out.json
    python -m kvbridge.bench.read_ab --modes checked,fused --sizes 4096,16384,65536,1073741824 --reps 12
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
from kvbridge.bench.transfer_cuda import (
    GIB,
    SEED,
    TIMEOUT,
    Case,
    PeerProcess,
    _enable_peer_access,
    _reset,
    _verify,
    gpu_pattern,
)

MODES = ("equal", "grow", "auto")
CHECK_MODES = ("checked", "fused")


def set_mode(mode: str) -> None:
    """Switch the cuda_ipc agent class (process-wide) to one mode's part sizes (the class's own for the
    check modes)."""
    from kvbridge.agents import cuda_ipc

    cuda_ipc.CudaIpcAgent.post_grow = None if mode in ("auto",) + CHECK_MODES else mode == "grow"


def cuda_ipc_default() -> None:
    """Back to the class's own choice (grow for small fragments only)."""
    from kvbridge.agents import cuda_ipc

    cuda_ipc.CudaIpcAgent.post_grow = None


def one_read(agent, peer: str, dst, case: Case, mode: str = "auto") -> float:
    from kvbridge.agents import DescriptorList, MemoryKind

    _reset(dst)
    t0 = time.perf_counter()
    local = DescriptorList(case.local_addrs, case.lens, MemoryKind.VRAM, 0)
    remote = DescriptorList(case.remote_addrs, case.lens, MemoryKind.VRAM, 1)
    if mode == "checked":
        local.validate()
        remote.validate()
    h = agent.read(peer, local, remote)
    h.wait(TIMEOUT)
    t = time.perf_counter() - t0
    h.release()
    if not _verify(dst, case):
        raise SystemExit(f"READ of {case.n} x {case.frag} bytes: destination differs from the expected bytes")
    return t


def main(argv=None) -> int:
    import torch
    from kvbridge.agents import MemoryRegion, create_agent

    p = argparse.ArgumentParser(prog="kvbridge.bench.read_ab", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=f"16384,65536,{GIB}")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {MODES + CHECK_MODES}")
    p.add_argument("--json")
    args = p.parse_args(argv)
    modes = tuple(args.modes.split(","))
    if not modes or set(modes) - set(MODES + CHECK_MODES):
        p.error(f"--modes: choose from {MODES + CHECK_MODES}, got {args.modes!r}")
    torch.cuda.set_device(0)
    _enable_peer_access(0, 1)
    peer_proc = PeerProcess(GIB, ["cuda_ipc"])
    live, out = [], {"benchmark": "read_ab", "modes": modes, "sizes": {}}
    try:
        dst = torch.empty(GIB, dtype=torch.uint8, device="cuda:0")
        pattern0 = gpu_pattern(GIB, "cuda:0", SEED).clone()
        torch.cuda.synchronize()
        agent = create_agent("cuda_ipc", f"ab-local-{os.getpid()}")  # as a user's: no timing events
        live.append((agent, agent.register_memory(MemoryRegion.of(dst))))
        name = agent.connect(peer_proc.metas["cuda_ipc"])
        peer_proc.connect("cuda_ipc", agent.metadata())
        rng = np.random.default_rng(0)
        for frag in (int(x) for x in args.sizes.split(",")):
            case = Case(frag, GIB, pattern0, rng)
            case.addresses(dst.data_ptr(), peer_proc.addr)
            times = {m: [] for m in modes}
            for rep in range(args.reps + 1):
                order = modes if rep % 2 else modes[::-1]
                for m in order:
                    set_mode(m)
                    t = one_read(agent, name, dst, case, m)
                    if rep:
                        times[m].append(t)
            row = {m: {"best_gbps": round(GIB / min(v) / 1e9, 1), "median_gbps": round(GIB / float(np.median(v)) / 1e9, 1),
                       "median_us": round(float(np.median(v)) * 1e6, 1), "us": [round(x * 1e6, 1) for x in v]}
                   for m, v in times.items()}
            out["sizes"][frag] = row
            print(f"{frag >> 10:>8} KiB x {case.n:>6}: " + "  ".join(
                f"{m} best {r['best_gbps']} median {r['median_gbps']} GB/s ({r['median_us']} us)" for m, r in row.items()),
                flush=True)
            del case
    finally:
        cuda_ipc_default()
        for a, reg in live:
            reg.release()
            a.close()
        peer_proc.close()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
