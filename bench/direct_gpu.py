"""The transceiver's direct path on two GPUs: one 1 GiB request per pull, context ranks on GPU1, generation
ranks on GPU0, each rank a process, through real CacheTransceivers (ZeroMQ control plane, the agent's reads).

For each split (ctx TP2 -> gen TP1, ctx TP1 -> gen TP2) it pulls `--requests` requests of 8192 tokens of a
Llama-8B-shaped KV (32 layers, 8 kv heads, head_dim 128, bf16, 16 tokens per block: 1 GiB), scattered block
ids on both sides, and reports per request `read_ms` (the pull's own "read" stage: first block ids received
-> every read settled; planning and posting included) and GB/s = bytes / read_ms, the slowest generation
rank's. The first request opens IPC handles and builds the kernel: rows say which request they are; the
summary takes the best of the later ones. Verification mode is on: both sides hash every layer of the request
after the reads and compare, so a row is `ok` only if every byte arrived (the hashing is not in `read_ms`).

    python -m kvbridge.bench.direct_gpu [--agent cuda_ipc] [--requests 4] [--option post_chunk=8192] [--json P]
        [--gen-option 1:launch_on=peer]   # an agent option for one generation rank only
        [--spread]                        # every rank on a GPU of its own (needs ctx_tp + gen_tp GPUs)

Placement: by default (two GPUs) the context ranks share GPU1 and the generation ranks GPU0, so a split
with two ranks on one side has two processes taking turns on one GPU. `--spread` puts generation rank r on
GPU r and context rank r on GPU gen_tp + r, as a deployment with a GPU per rank has them (rows say
`placement`).

Each rank process freezes its start-up heap once ready, as kvbridge's serving processes do (`gcheap`): the two
generation ranks of TP1 -> TP2 run the same code in step, and an unfrozen heap gave both a full collection in the
same request (one 188 GB/s row of 2026-11-26).

Needs 2 GPUs with peer access (torch with CUDA); `--spread` needs ctx_tp + gen_tp.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

import numpy as np

TOKENS, NB, TPB = 8192, 520, 16


def _layout(tp: int):
    from kvbridge.formatter.layout import KVLayout, KVShape, ParallelSplit

    return KVLayout(KVShape(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", tokens_per_block=TPB),
                    ParallelSplit(tp=tp))


def _fill(pool, salt: int):
    import torch

    words = pool.view(torch.int64)
    words.copy_(torch.arange(words.numel(), device=pool.device, dtype=torch.int64) * 0x9E3779B1 + salt)


def _rank(conn, role: str, tp: int, rank: int, device: int, instance: str, cfg: dict) -> None:
    import torch

    from kvbridge.gcheap import freeze_startup_heap
    from kvbridge.transceiver import CacheTransceiver, TransceiverConfig

    where = "cpu" if device < 0 else f"cuda:{device}"  # device -1: host memory (a smoke run without GPUs)
    if device >= 0:
        torch.cuda.set_device(device)
    layout = _layout(tp)
    pool = torch.empty(layout.block_bytes(rank) * NB, dtype=torch.uint8, device=where)
    _fill(pool, (1 + rank) << 40 if role == "context" else 7 << 40)
    if device >= 0:
        torch.cuda.synchronize()
    make = CacheTransceiver.context if role == "context" else CacheTransceiver.generation
    tr = make(pool, layout, rank, NB, TransceiverConfig(**cfg), instance=instance)
    freeze_startup_heap()
    conn.send(tr.endpoint if role == "context" else "ready")

    class Req:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    while conn.poll(300):
        cmd, arg = conn.recv()
        if cmd == "publish":
            rid, blocks, secret = arg
            tr.respond_and_send_async(Req(request_id=rid, block_ids=np.asarray(blocks), num_tokens=TOKENS,
                                          secret=secret))
            conn.send(True)
        elif cmd == "pull":
            rid, params, blocks = arg
            tr.request_and_receive_async(Req(request_id=rid, disagg_params=params, block_ids=np.asarray(blocks),
                                             num_tokens=TOKENS))
            (r,) = tr.check_gen_transfer_status(1, timeout_s=120)
            conn.send({k: v for k, v in r.__dict__.items() if k != "agents"})
        elif cmd == "status":
            conn.send(tr.sender.pinned)
        elif cmd == "exit":
            break
    tr.close()
    conn.send("bye")


class _Proc:
    """A rank process; started at once, `ready()` waits for its hello (all ranks start in parallel)."""

    def __init__(self, *args) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.p = ctx.Process(target=_rank, args=(child, *args), daemon=True)
        self.p.start()
        self.hello = None

    def ready(self) -> "_Proc":
        if not self.conn.poll(180):
            raise TimeoutError("a rank did not start within 180 s")
        self.hello = self.conn.recv()
        return self

    def call(self, cmd, arg=None, timeout=180):
        self.conn.send((cmd, arg))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"no answer to {cmd}")
        return self.conn.recv()

    def close(self) -> None:
        try:
            self.call("exit", timeout=30)
        except (TimeoutError, OSError, EOFError):
            pass
        self.p.join(20)
        if self.p.is_alive():
            self.p.kill()


def _gen_cfg(cfg: dict, agent: str, per_rank: dict[int, dict]) -> dict:
    """The generation side's config: `cfg` with `per_rank` ({rank: {option: value}} for `agent`) as its
    `rank_options` (a copy; the context side's config keeps none)."""
    if not per_rank:
        return cfg
    return {**cfg, "rank_options": {r: {agent: dict(o)} for r, o in per_rank.items()}}


def placement(ctx_tp: int, gen_tp: int, spread: bool) -> tuple[list[int], list[int]]:
    """(context ranks' GPUs, generation ranks' GPUs): shared (GPU1 / GPU0) or one GPU per rank."""
    if spread:
        return [gen_tp + r for r in range(ctx_tp)], list(range(gen_tp))
    return [1] * ctx_tp, [0] * gen_tp


def run_split(ctx_tp: int, gen_tp: int, cfg: dict, requests: int, cpu: bool = False,
              gen_options: dict[int, dict] | None = None, spread: bool = False) -> list[dict]:
    from kvbridge.transceiver import DisaggParams

    inst = f"direct-ctx-{time.monotonic_ns()}"
    gen_cfg = _gen_cfg(cfg, cfg["agents"][0], gen_options or {})
    ctx_gpus, gen_gpus = placement(ctx_tp, gen_tp, spread)
    ctx = [_Proc("context", ctx_tp, r, -1 if cpu else ctx_gpus[r], inst, cfg) for r in range(ctx_tp)]
    gen = [_Proc("generation", gen_tp, r, -1 if cpu else gen_gpus[r], "direct-gen", gen_cfg)
           for r in range(gen_tp)]
    rows = []
    try:
        endpoints = tuple(p.ready().hello for p in ctx)
        for p in gen:
            p.ready()
        rng = np.random.default_rng(0)
        for rid in range(1, requests + 1):
            cblocks = rng.permutation(NB)[:TOKENS // TPB].tolist()
            gblocks = rng.permutation(NB)[:TOKENS // TPB].tolist()
            secret = os.urandom(16)
            for p in ctx:
                p.call("publish", (rid, cblocks, secret))
            params = DisaggParams(rid, inst, endpoints, _layout(ctx_tp), secret).to_dict()
            for p in gen:
                p.conn.send(("pull", (rid, params, gblocks)))
            res = [p.conn.recv() if p.conn.poll(180) else None for p in gen]
            ok = all(r is not None and r["ok"] for r in res)
            nbytes = sum(r["nbytes"] for r in res) if ok else 0
            read_ms = max(r["timings_ms"]["read"] for r in res) if ok else float("nan")
            rows.append({"ctx_tp": ctx_tp, "gen_tp": gen_tp, "agent": cfg["agents"][0], "request": rid, "ok": ok,
                         "placement": {"ctx_gpus": ctx_gpus, "gen_gpus": gen_gpus},
                         "bytes": nbytes, "fragments": sum(r["fragments"] for r in res) if ok else 0,
                         "read_ms": round(read_ms, 3), "gbps": round(nbytes / read_ms / 1e6, 1) if ok else 0.0,
                         "timings_ms": [{k: round(v, 3) for k, v in r["timings_ms"].items()} for r in res if r],
                         "errors": [r["error"] for r in res if r and not r["ok"]]})
            print(json.dumps(rows[-1]), flush=True)
        deadline = time.monotonic() + 10
        while any(p.call("status") for p in ctx) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for p in ctx + gen:
            p.close()
    return rows


def _option(text: str) -> tuple[str, object]:
    k, _, v = text.partition("=")
    return k, (int(v) if v.lstrip("-").isdigit() else {"true": True, "false": False}.get(v, v))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvbridge.bench.direct_gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--agent", default="cuda_ipc")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--splits", default="2:1,1:2", help="ctx_tp:gen_tp pairs")
    ap.add_argument("--option", action="append", default=[], help="agent option key=value (repeatable)")
    ap.add_argument("--gen-option", action="append", default=[],
                    help="RANK:key=value, an agent option for that generation rank only (repeatable)")
    ap.add_argument("--cpu", action="store_true", help="pools in host memory (a smoke run of the harness)")
    ap.add_argument("--spread", action="store_true",
                    help="every rank on a GPU of its own (ctx_tp + gen_tp GPUs)")
    ap.add_argument("--json", help="append the rows here (JSON lines)")
    args = ap.parse_args(argv)
    cfg = {"agents": (args.agent,), "transfer_timeout_s": 120, "lease_s": 60, "heartbeat_s": 1, "verify": True}
    if args.option:
        cfg["options"] = {args.agent: dict(_option(o) for o in args.option)}
    gen_options: dict[int, dict] = {}
    for text in args.gen_option:
        rank, _, kv = text.partition(":")
        if not rank.isdigit() or "=" not in kv:
            ap.error(f"--gen-option wants RANK:key=value, got {text!r}")
        gen_options.setdefault(int(rank), {}).update([_option(kv)])
    rows = []
    for split in args.splits.split(","):
        c, g = (int(x) for x in split.split(":"))
        # (a --gen-option for a rank >= g has no rank to take it)
        rows += run_split(c, g, cfg, args.requests, args.cpu, gen_options, args.spread)
    for c, g in {(r["ctx_tp"], r["gen_tp"]) for r in rows}:
        later = [r for r in rows if (r["ctx_tp"], r["gen_tp"]) == (c, g) and r["request"] > 1 and r["ok"]]
        if later:
            best = min(later, key=lambda r: r["read_ms"])
            print(f"ctx TP{c} -> gen TP{g} {args.agent} {args.option} {args.gen_option} "
                  f"{'spread' if args.spread else 'shared'}: best read "
                  f"{best['read_ms']} ms = {best['gbps']} GB/s; all: {[r['gbps'] for r in later]}", flush=True)
    if args.json:
        with open(args.json, "a", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps({**r, "options": args.option, "gen_options": args.gen_option}) + "\n")
    return 0 if rows and all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
