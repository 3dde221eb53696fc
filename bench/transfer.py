"""`kvbridge bench transfer`: cross-process scattered READ bandwidth of each agent vs in-process memcpy.

A peer process registers a buffer of `--total` bytes of position-dependent values; this process reads it in
fragments of each size, scattered (random slot order on both sides), through each agent, and checks every
byte of the destination after every run. The baseline is an in-process copy of the same fragments measured
in the same run (the faster of a per-fragment memmove loop and a vectorised numpy gather/scatter).

    kvbridge bench transfer [--agents nixl,cma,tcp] [--sizes 16K,64K,512K,4M] [--total 1G] [--json PATH]
    kvbridge bench transfer --device cuda ...   (GPU agents; see bench/transfer_cuda.py)
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import multiprocessing as mp
import os
import sys
import time

import numpy as np

from .common import machine, pattern, table, write_json

DEFAULT_AGENTS = ["nixl", "examples.custom_agent:CmaAgent", "tcp"]


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "KMG" else s) * mult)


def _agent_class(spec: str):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if ":" in spec:
        if root not in sys.path:
            sys.path.insert(0, root)
        mod, _, attr = spec.partition(":")
        return getattr(importlib.import_module(mod), attr)
    from kvbridge.agents import get_agent_class

    return get_agent_class(spec)


def _peer(conn, spec: str, nbytes: int) -> None:
    from kvbridge.agents import MemoryRegion

    agent = _agent_class(spec)(f"bench-peer-{os.getpid()}")
    buf = pattern(nbytes, 3).copy()
    reg = agent.register_memory(MemoryRegion.of(buf))
    conn.send((agent.metadata(), int(buf.ctypes.data)))
    while conn.poll(600):
        cmd, arg = conn.recv()
        if cmd == "connect":
            conn.send(agent.connect(arg))
        elif cmd == "exit":
            break
    reg.release()
    agent.close()


def _memcpy_gbps(dst: np.ndarray, src: np.ndarray, ps: np.ndarray, pd: np.ndarray, frag: int, repeat: int) -> float:
    """In-process copy of the same scattered fragments: best of a memmove loop and a numpy gather/scatter."""
    n = ps.size
    best = float("inf")
    memmove = ctypes.memmove
    sb, db = int(src.ctypes.data), int(dst.ctypes.data)
    so, do = (ps * frag + sb).tolist(), (pd * frag + db).tolist()
    for _ in range(repeat):
        t = time.perf_counter()
        for s, d in zip(so, do):
            memmove(d, s, frag)
        best = min(best, time.perf_counter() - t)
        s2, d2 = src.reshape(n, frag), dst.reshape(n, frag)
        t = time.perf_counter()
        d2[pd] = s2[ps]
        best = min(best, time.perf_counter() - t)
    return n * frag / best / 1e9


def bench_agent(spec: str, sizes: list[int], total: int, repeat: int, src_local: np.ndarray,
                dst: np.ndarray) -> list[dict]:
    from kvbridge.agents import DescriptorList, MemoryRegion

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_peer, args=(child, spec, total), daemon=True)
    proc.start()
    rows = []
    try:
        if not conn.poll(120):
            raise TimeoutError(f"{spec}: peer did not start")
        meta, raddr = conn.recv()
        agent = _agent_class(spec)(f"bench-{os.getpid()}-{abs(hash(spec)) % 1000}")
        reg = agent.register_memory(MemoryRegion.of(dst))
        peer = agent.connect(meta)
        conn.send(("connect", agent.metadata()))
        conn.poll(60) and conn.recv()
        rng = np.random.default_rng(0)
        for frag in sizes:
            n = total // frag
            ps, pd = rng.permutation(n).astype(np.int64), rng.permutation(n).astype(np.int64)
            local = DescriptorList(dst.ctypes.data + pd * frag, np.full(n, frag))
            remote = DescriptorList(raddr + ps * frag, np.full(n, frag))
            best, ok = float("inf"), True
            for _ in range(repeat):
                dst.fill(0xA5)
                t = time.perf_counter()
                h = agent.read(peer, local, remote)
                h.wait(600)
                best = min(best, time.perf_counter() - t)
                h.release()
                ok &= bool(np.array_equal(dst.reshape(n, frag)[pd], src_local.reshape(n, frag)[ps]))
            base = _memcpy_gbps(dst, src_local, ps, pd, frag, repeat)
            name = spec.rsplit(":", 1)[-1] if ":" in spec else spec
            rows.append({"agent": name, "fragment_bytes": frag, "fragments": n, "gbps": total / best / 1e9,
                         "baseline_gbps": base, "verified": ok})
            print(table(rows[-1:], list(rows[-1])).splitlines()[-1], flush=True)
        reg.release()
        agent.close()
    finally:
        conn.send(("exit", None))
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvbridge bench transfer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--agents", default=",".join(DEFAULT_AGENTS), help="registry names or module:Class")
    ap.add_argument("--sizes", default="16K,64K,512K,4M")
    ap.add_argument("--total", default="1G", help="bytes moved per fragment size")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        from . import transfer_cuda

        rows = transfer_cuda.run(args)
        write_json(args.json, rows)
        return 0 if all(r.get("verified", True) for r in rows) else 1
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    total = parse_size(args.total)
    print(f"# host-memory READ, 2 processes, {total >> 20} MiB per size, best of {args.repeat}; {machine()}")
    src_local = pattern(total, 3).copy()
    dst = np.empty(total, dtype=np.uint8)
    rows: list[dict] = []
    print(table([], ["agent", "fragment_bytes", "fragments", "gbps", "baseline_gbps", "verified"]))
    for spec in args.agents.split(","):
        try:
            rows += bench_agent(spec, sizes, total, args.repeat, src_local, dst)
        except Exception as e:  # noqa: BLE001 - an unavailable agent must not stop the others
            print(f"{spec}: skipped ({type(e).__name__}: {e})", flush=True)
    write_json(args.json, rows)
    return 0 if rows and all(r["verified"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
