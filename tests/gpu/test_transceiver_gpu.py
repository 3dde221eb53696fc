"""End to end on GPUs through the transceiver: a context executor's pools at TP2 (two processes on GPU1) pulled
by a generation rank at TP1 on GPU0, and the reverse (TP1 on GPU1 -> TP2 on GPU0), 1 GiB per request.

Pools hold position-dependent values made on the GPU. Every byte of the request is checked by verification
mode (both sides hash every layer of what they hold, in canonical order, and compare); every byte outside the
request's blocks is compared with its value before the pull. Prints achieved GB/s (read phase) per agent.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time

import numpy as np
import pytest

from kvbridge.formatter.layout import KVLayout, KVShape, ParallelSplit

SHAPE = KVShape(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", tokens_per_block=16)
TOKENS = 8192  # 512 blocks: 1 GiB of KV per request at TP1
NB = 520
RESULTS = os.environ.get("KVBRIDGE_GPU_RESULTS")  # optional JSON lines file for the run's record


def _rank(conn, role: str, layout_wire: dict, rank: int, device: int, instance: str, cfg: dict) -> None:
    import torch

    from kvbridge.transceiver import CacheTransceiver, TransceiverConfig

    torch.cuda.set_device(device)
    layout = KVLayout.from_wire(layout_wire)
    nbytes = layout.block_bytes(rank) * NB
    pool = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
    words = pool.view(torch.int64)
    words.copy_(torch.arange(words.numel(), device=pool.device, dtype=torch.int64) * 0x9E3779B1
                + (hash((role, rank)) & 0xFFFF) * (1 << 40) + 0x5DEECE66D)
    torch.cuda.synchronize()
    make = CacheTransceiver.context if role == "context" else CacheTransceiver.generation
    tr = make(pool, layout, rank, NB, TransceiverConfig(**cfg), instance=instance)
    conn.send(tr.endpoint if role == "context" else "ready")

    class Req:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    while conn.poll(300):
        cmd, arg = conn.recv()
        if cmd == "publish":  # (rid, blocks, n, secret[, layers ready: streamed])
            rid, blocks, n, secret = arg[:4]
            tr.respond_and_send_async(Req(request_id=rid, block_ids=np.asarray(blocks), num_tokens=n, secret=secret,
                                          layers_ready=arg[4] if len(arg) > 4 else None))
            conn.send(True)
        elif cmd == "layers":  # (rid, local layers now final)
            tr.sender.mark_layers_ready(*arg)
            conn.send(True)
        elif cmd == "pull":
            rid, params, blocks, n = arg
            before = pool.clone()
            tr.request_and_receive_async(Req(request_id=rid, disagg_params=params, block_ids=np.asarray(blocks),
                                             num_tokens=n))
            (r,) = tr.check_gen_transfer_status(1, timeout_s=120)
            torch.cuda.synchronize()
            owner = torch.arange(nbytes, device=pool.device) // layout.block_bytes(rank)
            outside = ~torch.isin(owner, torch.as_tensor(blocks, device=pool.device))
            untouched = bool(torch.equal(pool[outside], before[outside]))
            ipc = tr.pool.agents.get("cuda_ipc")  # which GPUs ran this rank's copy kernels (launch_on)
            conn.send({**r.__dict__, "untouched": untouched, "kernel_gpus": sorted(ipc._engines) if ipc else []})
        elif cmd == "status":
            conn.send(tr.sender.pinned)
        elif cmd == "exit":
            break
    tr.close()
    conn.send("bye")


class _Proc:
    def __init__(self, *args) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.p = ctx.Process(target=_rank, args=(child, *args), daemon=True)
        self.p.start()
        assert self.conn.poll(120), "rank did not start"
        self.hello = self.conn.recv()

    def call(self, cmd, arg=None, timeout=180):
        self.conn.send((cmd, arg))
        assert self.conn.poll(timeout), f"no answer to {cmd}"
        return self.conn.recv()

    def send(self, cmd, arg=None):
        self.conn.send((cmd, arg))

    def close(self):
        try:
            self.call("exit", timeout=30)
        except (AssertionError, OSError, EOFError):
            pass
        self.p.join(20)
        if self.p.is_alive():
            self.p.kill()


@pytest.mark.cuda
@pytest.mark.multigpu
@pytest.mark.parametrize("agents", [["cuda_ipc"], ["cuda_ipc", "peer1"], ["nixl"], ["nixl", "staged"],
                                    ["nixl", "host"], ["nixl", "host", "streamed"]],
                         ids=["cuda_ipc", "cuda_ipc_rank1_on_peer", "nixl", "nixl_staged", "nixl_host_staged",
                              "nixl_host_streamed"])
@pytest.mark.parametrize("ctx_tp, gen_tp", [(2, 1), (1, 2)], ids=["ctx_tp2_gpu1_to_gen_tp1_gpu0",
                                                                   "ctx_tp1_gpu1_to_gen_tp2_gpu0"])
def test_gpu_pull_through_the_transceiver_is_byte_exact(ctx_tp, gen_tp, agents):
    from kvbridge.transceiver import DisaggParams

    ctx_l, gen_l = KVLayout(SHAPE, ParallelSplit(tp=ctx_tp)), KVLayout(SHAPE, ParallelSplit(tp=gen_tp))
    host, streamed = "host" in agents, "streamed" in agents  # host: VRAM pools staged through pinned host memory
    staged = "staged" in agents or host
    peer1 = "peer1" in agents  # generation rank 1's kernel on the context's GPU: transceiver.rank_options
    agents = [a for a in agents if a not in ("staged", "host", "streamed", "peer1")]
    cfg = {"agents": tuple(agents), "verify": True, "transfer_timeout_s": 120, "lease_s": 60, "heartbeat_s": 1,
           "staging_arena_bytes": (1 << 30) + (64 << 20) if staged else 0,
           "staging_memory": "host" if host else "device", "stream_layers": streamed}
    gen_cfg = {**cfg, "rank_options": {1: {"cuda_ipc": {"launch_on": "peer"}}}} if peer1 else cfg
    inst = f"gpu-ctx-{time.monotonic_ns()}"
    ctx = [_Proc("context", ctx_l.to_wire(), r, 1, inst, cfg) for r in range(ctx_tp)]
    gen = [_Proc("generation", gen_l.to_wire(), r, 0, "gpu-gen", gen_cfg) for r in range(gen_tp)]
    try:
        endpoints = tuple(p.hello for p in ctx)
        rng = np.random.default_rng(0)
        rows = []
        for rid in (1, 2):  # the first pull also opens IPC handles and compiles the kernel: time the second
            cblocks = rng.permutation(NB)[:TOKENS // 16].tolist()
            gblocks = rng.permutation(NB)[:TOKENS // 16].tolist()
            secret = os.urandom(16)  # every context rank of the request pins it under the same secret
            for p in ctx:
                p.call("publish", (rid, cblocks, TOKENS, secret) + ((0,) if streamed else ()))
            params = DisaggParams(rid, inst, endpoints, ctx_l, secret).to_dict()
            for p in gen:
                p.send("pull", (rid, params, gblocks, TOKENS))
            for k in (8, 16, 24, 32) if streamed else ():  # layers become final while the pull runs
                for p in ctx:
                    p.call("layers", (rid, k))
            res = [p.conn.recv() if p.conn.poll(180) else None for p in gen]
            for r in res:
                assert r is not None and r["ok"], r
                assert r["untouched"]
                assert r["agents"] == tuple(agents) or list(r["agents"]) == agents
            if agents == ["cuda_ipc"]:  # rank 0 copies on its own GPU; rank 1 on the context's with peer1
                assert [r["kernel_gpus"] for r in res] == [[0], [1] if peer1 else [0]][:gen_tp], res
            nbytes = sum(r["nbytes"] for r in res)
            read_ms = max(r["timings_ms"]["read"] for r in res)
            what = " staged-host" + (" streamed" if streamed else "") if host else " staged" if staged else \
                " rank1-peer" if peer1 else ""
            rows.append({"ctx_tp": ctx_tp, "gen_tp": gen_tp, "agent": agents[0] + what,
                         "request": rid, "bytes": nbytes,
                         "fragments": sum(r["fragments"] for r in res), "read_ms": round(read_ms, 3),
                         "gbps": round(nbytes / read_ms / 1e6, 1),
                         "total_ms": round(max(r["timings_ms"]["total"] for r in res), 1)})
            print(json.dumps(rows[-1]))
        deadline = time.monotonic() + 10
        while any(p.call("status") for p in ctx) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(p.call("status") for p in ctx)
        assert rows[-1]["bytes"] == SHAPE.num_layers * 2 * 8 * 128 * 2 * TOKENS  # 1 GiB
        if staged and not streamed:  # one descriptor per context rank read from
            assert rows[-1]["fragments"] == max(ctx_tp, gen_tp), rows[-1]
        if streamed:  # one descriptor per context rank read from and layer step at most
            assert max(ctx_tp, gen_tp) <= rows[-1]["fragments"] <= 4 * max(ctx_tp, gen_tp), rows[-1]
        if RESULTS:
            with open(RESULTS, "a") as f:
                f.write(json.dumps(rows[-1]) + "\n")
    finally:
        for p in ctx + gen:
            p.close()


@pytest.mark.cuda
def test_a_host_staging_arena_is_pinned_and_leaves_out_agents_that_cannot_register_it():
    import torch

    from kvbridge.agents import MemoryKind
    from kvbridge.errors import AgentError
    from kvbridge.transceiver import TransceiverConfig
    from kvbridge.transceiver.pool import LocalPool

    lay = KVLayout(SHAPE, ParallelSplit(tp=1))
    pool = torch.zeros(lay.block_bytes(0) * 4, dtype=torch.uint8, device="cuda:0")
    cfg = TransceiverConfig(agents=("cuda_ipc",), staging_arena_bytes=1 << 20, staging_memory="host")
    with pytest.raises(AgentError, match="host staging arena"):
        LocalPool(lay, 0, pool, 4, cfg)
    lp = LocalPool(lay, 0, pool, 4, cfg.with_(agents=("cuda_ipc", "nixl")))
    try:
        assert list(lp.agents) == ["nixl"]
        assert lp.arena.kind is MemoryKind.DRAM and lp.arena.buffer.is_pinned()
    finally:
        lp.close()


@pytest.mark.cuda
def test_packing_a_vram_pool_into_a_host_arena_equals_packing_it_on_the_device():
    import torch

    from kvbridge.agents import MemoryKind
    from kvbridge.formatter.mapping import mapping_for
    from kvbridge.formatter.planner import RankPool
    from kvbridge.formatter.staging import staging_nbytes
    from kvbridge.transceiver import staging

    ctx, gen = KVLayout(SHAPE, ParallelSplit(tp=2)), KVLayout(SHAPE, ParallelSplit(tp=1))
    nb, n = 40, 600
    src = torch.arange(ctx.block_bytes(0) * nb // 8, device="cuda:0", dtype=torch.int64).mul_(0x9E3779B1)
    src = src.view(torch.uint8)
    rp = RankPool.of(ctx, 0, [src.data_ptr()], nb, MemoryKind.VRAM, 0)
    (piece,) = [p for p in mapping_for(ctx, gen).pieces(0) if p.ctx_rank == 0]
    blocks = np.random.default_rng(0).permutation(nb)[:-(-n // SHAPE.tokens_per_block)]
    nbytes = staging_nbytes(ctx, piece, n, 5)
    host = staging.StagingArena(MemoryKind.VRAM, 0, nbytes + 4096, "host")
    dev = staging.StagingArena(MemoryKind.VRAM, 0, nbytes + 4096, "device")
    a, b = host.alloc(nbytes), dev.alloc(nbytes)
    staging.pack(piece, rp, blocks, n, host, a, 5)
    staging.pack(piece, rp, blocks, n, dev, b, 5)
    assert torch.equal(host.view(a, nbytes), dev.view(b, nbytes).cpu())
    # a layer range at its offset, then the unpack back into a zeroed pool, chunked far below the piece
    back = torch.zeros_like(src)
    bp = RankPool.of(ctx, 0, [back.data_ptr()], nb, MemoryKind.VRAM, 0)
    sub, off, _nb = staging.layer_range(piece, range(3, 9), ctx, n, 5)
    staging.unpack(sub, bp, blocks, n, host, a + off, 5)
    want = torch.zeros_like(src)
    staging.unpack(sub, RankPool.of(ctx, 0, [want.data_ptr()], nb, MemoryKind.VRAM, 0), blocks, n, dev, b + off, 5)
    assert torch.equal(back, want) and bool(back.any())
    # the bounded device buffer: chunks far smaller than the copy, both ways
    addrs = src.data_ptr() + np.arange(0, 1 << 20, 4096, dtype=np.int64)
    lengths = np.full(addrs.shape, 1024, dtype=np.int64)
    slot = torch.empty(int(lengths.sum()), dtype=torch.uint8).pin_memory()
    staging.through_temp(MemoryKind.VRAM, 0, addrs, lengths, slot, True, chunk_bytes=10000)
    assert torch.equal(slot, src[:1 << 20].view(-1, 4096)[:, :1024].reshape(-1).cpu())
    zero = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda:0")
    staging.through_temp(MemoryKind.VRAM, 0, zero.data_ptr() + (addrs - src.data_ptr()), lengths, slot, False,
                         chunk_bytes=10000)
    assert torch.equal(zero.view(-1, 4096)[:, :1024], src[:1 << 20].view(-1, 4096)[:, :1024])
    assert not zero.view(-1, 4096)[:, 1024:].any()
