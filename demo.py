"""`make demo` / `kvbridge demo`: the main job on an embedded default, on CPU, with no network.

Today: a context executor of two ranks (TP2, two processes) holds the KV of a few requests; a generation rank
(TP1, this process) pulls them through ZeroMQ + NIXL's UCX backend into scattered blocks, and every byte of
its pool is checked. Prints what moved. (The serving issue replaces this with a real model behind a router.)
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time

import numpy as np

from .formatter.layout import KVLayout, KVShape, ParallelSplit
from .formatter.verify import pool_image
from .transceiver import CacheTransceiver, DisaggParams, TransceiverConfig

SHAPE = KVShape(num_layers=30, num_kv_heads=3, head_dim=64, dtype="bfloat16", tokens_per_block=16)  # SmolLM2
CTX = KVLayout(SHAPE, ParallelSplit(tp=3))
GEN = KVLayout(SHAPE, ParallelSplit(tp=1))
BLOCKS = 256
PROMPTS = [37, 512, 1000, 5, 300]


class _Req:
    def __init__(self, **kw) -> None:
        self.__dict__.update(kw)


def _ctx_rank(rank: int, conn, instance: str, requests) -> None:
    buf = pool_image(CTX, rank, BLOCKS, [r[1:] for r in requests], background_salt=1 + rank).copy()
    tr = CacheTransceiver.context(buf, CTX, rank, BLOCKS, TransceiverConfig(agents=("nixl",)), instance=instance)
    for rid, blocks, n, _ in requests:
        tr.respond_and_send_async(_Req(request_id=rid, block_ids=np.asarray(blocks), num_tokens=n))
    conn.send(tr.endpoint)
    deadline = time.monotonic() + 120
    done = 0
    while done < len(requests) and time.monotonic() < deadline:
        done += len(tr.check_context_transfer_status(timeout_s=0))
        time.sleep(0.01)
    conn.send((done, tr.sender.pinned))
    tr.close()


def main(argv: list[str] | None = None) -> int:
    rng = np.random.default_rng(0)
    free_c, free_g = list(rng.permutation(BLOCKS)), list(rng.permutation(BLOCKS))
    reqs, pulls = [], []
    for i, n in enumerate(PROMPTS):
        nb = -(-n // 16)
        reqs.append((100 + i, [int(free_c.pop()) for _ in range(nb)], n, 100 + i))
        pulls.append((100 + i, [int(free_g.pop()) for _ in range(nb)], n, 100 + i))
    print(f"kvbridge demo: context {CTX.describe()}\n               generation {GEN.describe()}")
    instance = "demo-ctx"
    mpc = mp.get_context("spawn")
    procs, conns = [], []
    for r in range(CTX.world_size):
        a, b = mpc.Pipe()
        p = mpc.Process(target=_ctx_rank, args=(r, b, instance, reqs), daemon=True)
        p.start()
        procs.append(p)
        conns.append(a)
    endpoints = []
    for c in conns:
        if not c.poll(60):
            print("context rank did not start", file=sys.stderr)
            return 1
        endpoints.append(c.recv())
    buf = pool_image(GEN, 0, BLOCKS, [], background_salt=100).copy()
    gen = CacheTransceiver.generation(buf, GEN, 0, BLOCKS, TransceiverConfig(agents=("nixl",)))
    for rid, blocks, n, _ in pulls:
        gen.request_and_receive_async(_Req(request_id=rid, block_ids=np.asarray(blocks), num_tokens=n,
                                           disagg_params=DisaggParams(rid, instance, tuple(endpoints), CTX)))
    results = gen.check_gen_transfer_status(len(pulls), timeout_s=60)
    ok_all = True
    print(f"\n{'request':>8} {'tokens':>7} {'bytes':>10} {'fragments':>9} {'ms':>7}  agent  result")
    for r in sorted(results, key=lambda r: r.request_id):
        n = next(p[2] for p in pulls if p[0] == r.request_id)
        ok_all &= r.ok
        print(f"{r.request_id:>8} {n:>7} {r.nbytes:>10} {r.fragments:>9} {r.timings_ms['total']:>7.1f}  "
              f"{','.join(r.agents):5}  {'ok' if r.ok else r.error}")
    want = pool_image(GEN, 0, BLOCKS, [p[1:] for p in pulls], background_salt=100)
    bad = int(np.count_nonzero(buf != want))
    print(f"\ngeneration pool: {buf.nbytes} bytes compared, {bad} differ")
    for c in conns:
        done, pinned = c.recv() if c.poll(60) else (0, -1)
        ok_all &= pinned == 0
        print(f"context rank: {done} requests released, {pinned} blocks-sets still pinned")
    gen.close()
    for p in procs:
        p.join(10)
    ok_all &= bad == 0
    print("\nOK: every byte arrived and every pinned block was released." if ok_all else "\nFAILED")
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
