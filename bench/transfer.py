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
import multiprocessing as mp
import os
import sys
import time
import traceback

import numpy as np

from .common import machine, pattern, table, write_json

DEFAULT_AGENTS = ["nixl", "examples.custom_agent:CmaAgent", "tcp"]


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "KMG" else s) * mult)


def _agent_class(spec: str):
    """A registry name or module:Class, found the way `kvbridge check-agent` finds it (sys.path, then the
    working directory, then inside the kvbridge package)."""
    from kvbridge.agents.conformance.peer import resolve

    return resolve(spec)


def _peer(conn, spec: str, nbytes: int) -> None:
    from kvbridge.agents import MemoryRegion

    try:
        agent = _agent_class(spec)(f"bench-peer-{os.getpid()}")
        buf = pattern(nbytes, 3).copy()
        reg = agent.register_memory(MemoryRegion.of(buf))
        conn.send((agent.metadata(), int(buf.ctypes.data)))
    except BaseException:  # noqa: BLE001 - the parent prints it and fails the run
        conn.send(("error", traceback.format_exc()))
        return
    while conn.poll(600):
        cmd, arg = conn.recv()
        if cmd == "connect":
            conn.send(agent.connect(arg))
        elif cmd == "exit":
            break
    reg.release()
    agent.close()


class PeerFailed(RuntimeError):
    """The benchmark's peer process could not start the agent (its traceback is in the message)."""


def _wait_started(conn, proc, spec: str, timeout: float = 120.0):
    """The peer's (metadata, address); PeerFailed at once if it raised or died, TimeoutError if it hangs."""
    deadline = time.monotonic() + timeout
    while not conn.poll(0.2):
        if not proc.is_alive() and not conn.poll(0):
            raise PeerFailed(f"{spec}: the peer process died while starting (exit code {proc.exitcode})")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{spec}: the peer process did not start within {timeout:g} s")
    msg = conn.recv()
    if isinstance(msg, tuple) and len(msg) == 2 and msg[0] == "error":
        raise PeerFailed(f"{spec}: the peer process failed while starting:\n{msg[1].rstrip()}")
    return msg


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
        meta, raddr = _wait_started(conn, proc, spec)
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
        if proc.is_alive():
            conn.send(("exit", None))
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvbridge bench transfer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where the buffers live (default cpu)")
    ap.add_argument("--agents", default=None,
                    help=f"comma-separated registry names or MODULE:CLASS (found as check-agent finds them); "
                         f"an agent named here that fails makes the exit code 1 (default: "
                         f"{','.join(DEFAULT_AGENTS)}, each skipped if unavailable)")
    ap.add_argument("--sizes", default="16K,64K,512K,4M", help="fragment sizes (default 16K,64K,512K,4M)")
    ap.add_argument("--total", default="1G", help="bytes moved per fragment size (default 1G)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per size; the best counts (default 3)")
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
    named = args.agents is not None
    failed = []
    for spec in (args.agents.split(",") if named else DEFAULT_AGENTS):
        try:
            rows += bench_agent(spec, sizes, total, args.repeat, src_local, dst)
        except Exception as e:  # noqa: BLE001 - an unavailable agent must not stop the others
            if named:
                failed.append(spec)
                print(f"{spec}: FAILED ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
            else:
                print(f"{spec}: skipped ({type(e).__name__}: {e})", flush=True)
    write_json(args.json, rows)
    return 0 if rows and not failed and all(r["verified"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
