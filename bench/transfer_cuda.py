"""GPU transfer benchmark: GPU1 -> GPU0 scattered READs across processes, every byte verified on the GPU.

For each fragment size (4 KiB ... 4 MiB, 1 GiB in all per size) it moves the same scattered fragments
(random permutations on both sides) with:
  - cuda_ipc: kvbridge's CudaIpcAgent, peer process on cuda:1, this process on cuda:0;
  - nixl:     NIXL's UCX backend on the same VRAM and descriptors (if NIXL loads);
  - memcpy_peer: one cudaMemcpyPeerAsync per fragment, in-process (the copy-engine-per-descriptor way);
and, as the ceiling, one 1 GiB cudaMemcpyPeerAsync in-process. After every transfer the whole 1 GiB
destination is compared on the GPU with the expected bytes (torch.equal), so every row is verified.

Rows: {agent, fragment_bytes, fragments, gbps, baseline_gbps (the 1 GiB ceiling), verified, seconds, ...}.
`gbps` is end to end for one READ of the whole 1 GiB: DescriptorList construction, validation, staging,
upload, copy, completion seen by `wait` (absolute addresses are computed before timing, as a planner
would). Agent rows add post_ms (until `read` returned); cuda_ipc rows add gpu_gbps (descriptor upload +
kernel, CUDA events on the agent's stream) and pipelined_gbps (the 1 GiB posted as 8 READs back to back).

    python -m kvbridge.bench.transfer_cuda --json out.json

Needs 2 GPUs with peer access, torch with CUDA and cuda-bindings (pip install 'kvbridge[gpu]').
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

import numpy as np

GIB = 1 << 30
SIZES = [4 << 10, 16 << 10, 64 << 10, 128 << 10, 512 << 10, 4 << 20]
SEED = 3
TIMEOUT = 120.0


def gpu_pattern(nbytes: int, device: str, seed: int):
    """nbytes of position-dependent bytes made on the GPU (no two 8-byte words equal)."""
    import torch

    w = torch.arange(-(-nbytes // 8), dtype=torch.int64, device=device)
    w = w * 0x9E3779B1 + (seed << 40) + 0x5DEECE66D
    return w.view(torch.uint8)[:nbytes]


# --- the peer process: owns the source buffer on cuda:1 -------------------------------------------------
def _peer_main(conn, total: int, agents: list[str]) -> None:
    import torch

    from kvbridge.agents import MemoryRegion, create_agent

    torch.cuda.set_device(1)
    src = gpu_pattern(total, "cuda:1", SEED).clone()
    torch.cuda.synchronize()
    live, regs, metas = {}, [], {}
    for kind in agents:
        try:
            a = create_agent(kind, f"bench-peer-{kind}-{os.getpid()}")
        except Exception as e:  # noqa: BLE001 - reported to the parent, which skips that agent
            metas[kind] = f"unavailable: {e}"
            continue
        live[kind] = a
        regs.append(a.register_memory(MemoryRegion.of(src)))
        metas[kind] = a.metadata()
    conn.send((metas, src.data_ptr()))
    while conn.poll(600):
        cmd, arg = conn.recv()
        if cmd == "connect":
            kind, blob = arg
            conn.send(live[kind].connect(blob))
        else:
            break
    for r in regs:
        r.release()
    for a in live.values():
        a.close()


class PeerProcess:
    def __init__(self, total: int, agents: list[str]) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_peer_main, args=(child, total, agents), daemon=True)
        self.proc.start()
        if not self.conn.poll(180):
            self.proc.kill()
            raise TimeoutError("benchmark peer process did not start within 180 s")
        self.metas, self.addr = self.conn.recv()

    def connect(self, kind: str, blob: bytes) -> str:
        self.conn.send(("connect", (kind, blob)))
        if not self.conn.poll(60):
            raise TimeoutError(f"peer did not connect its {kind} agent within 60 s")
        return self.conn.recv()

    def close(self) -> None:
        try:
            self.conn.send(("exit", None))
        except OSError:
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


# --- measurements ---------------------------------------------------------------------------------------
class Case:
    """One fragment size: the scattered offsets and the expected destination bytes (on cuda:0)."""

    def __init__(self, frag: int, total: int, pattern0, rng) -> None:
        import torch

        self.frag, self.n = frag, total // frag
        self.src_off = rng.permutation(self.n).astype(np.int64) * frag
        self.dst_off = rng.permutation(self.n).astype(np.int64) * frag
        inv = np.empty(self.n, dtype=np.int64)
        inv[self.dst_off // frag] = self.src_off // frag
        rows = torch.from_numpy(inv).to("cuda:0")
        self.expected = pattern0[: self.n * frag].view(self.n, frag)[rows].view(-1)
        self.lens = np.full(self.n, frag, dtype=np.int64)
        self.local_addrs = self.remote_addrs = None

    def addresses(self, local_base: int, remote_base: int) -> None:
        """Absolute addresses (the caller's planning, done before timing, as a transceiver would)."""
        self.local_addrs = local_base + self.dst_off
        self.remote_addrs = remote_base + self.src_off


def _verify(dst, case: Case) -> bool:
    import torch

    torch.cuda.synchronize(0)
    return bool(torch.equal(dst[: case.expected.numel()], case.expected))


def _reset(dst) -> None:
    import torch

    dst.fill_(0xA5)
    torch.cuda.synchronize(0)


def time_agent(agent, peer: str, dst, remote_addr: int, case: Case, reps: int, pieces: int = 1):
    """(best wall seconds, best GPU seconds or None, best seconds to post, verified) for READs of the case.

    The case is posted as `pieces` transfers back to back, then waited for. The first run warms up (kernel
    load, UCX handle opening) and is not timed. GPU seconds come from agents made with timing=True.
    """
    from kvbridge.agents import DescriptorList, MemoryKind

    times, gpu, posts, ok = [], [], [], True
    bounds = np.linspace(0, case.n, pieces + 1).astype(np.int64)
    case.addresses(dst.data_ptr(), remote_addr)
    for _ in range(reps + 1):
        _reset(dst)
        t0 = time.perf_counter()
        handles = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            loc = DescriptorList(case.local_addrs[a:b], case.lens[a:b], MemoryKind.VRAM, 0)
            rem = DescriptorList(case.remote_addrs[a:b], case.lens[a:b], MemoryKind.VRAM, 1)
            handles.append(agent.read(peer, loc, rem))
        posts.append(time.perf_counter() - t0)
        for h in handles:
            h.wait(TIMEOUT)
        times.append(time.perf_counter() - t0)
        g = [getattr(h, "gpu_seconds", None) for h in handles]
        if pieces == 1 and g[0] is not None:
            gpu.append(g[0])
        for h in handles:
            h.release()
        ok &= _verify(dst, case)
    return min(times[1:]), (min(gpu[1:]) if len(gpu) > 1 else None), min(posts[1:]), ok


def time_memcpy_peer(dst, src1, pattern0, case: Case | None, total: int, reps: int):
    """One cudaMemcpyPeerAsync per fragment (or one for all `total` bytes when case is None), in-process.

    Returns (best wall seconds, verified). The single copy is verified against the source pattern.
    """
    import torch
    from cuda.bindings import runtime as rt

    stream = torch.cuda.current_stream(0).cuda_stream
    d0, s1 = dst.data_ptr(), src1.data_ptr()
    times, ok = [], True
    for _ in range(reps + 1):
        _reset(dst)
        t0 = time.perf_counter()
        if case is None:
            (err,) = rt.cudaMemcpyPeerAsync(d0, 0, s1, 1, total, stream)
        else:
            f = case.frag
            for d, s in zip(case.dst_off.tolist(), case.src_off.tolist()):
                (err,) = rt.cudaMemcpyPeerAsync(d0 + d, 0, s1 + s, 1, f, stream)
        torch.cuda.synchronize(0)
        times.append(time.perf_counter() - t0)
        if int(err) != 0:
            raise RuntimeError(f"cudaMemcpyPeerAsync failed: {err}")
        ok &= bool(torch.equal(dst[:total], pattern0[:total])) if case is None else _verify(dst, case)
    return min(times[1:]), ok


def _size(v) -> int:
    if isinstance(v, int):
        return v
    v = str(v).strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(v[-1:], 1)
    return int(float(v[:-1] if v[-1:] in "KMG" else v) * mult)


def _options(args) -> tuple[int, list[int], list[str], int]:
    """(total bytes, fragment sizes, agents, reps) from this module's CLI or `kvbridge bench transfer`'s."""
    from kvbridge.agents import MemoryKind, get_agent_class

    if getattr(args, "total_mib", None):
        total = int(args.total_mib) << 20
    else:
        total = _size(getattr(args, "total", None) or GIB)
    sizes = getattr(args, "sizes", None) or SIZES
    sizes = [_size(x) for x in (sizes.split(",") if isinstance(sizes, str) else sizes)]
    given = getattr(args, "agents", None) or ["cuda_ipc", "nixl"]
    given = given.split(",") if isinstance(given, str) else list(given)
    agents = ["cuda_ipc"]
    for name in given:
        try:
            ok = ":" not in name and MemoryKind.VRAM in get_agent_class(name).memory_kinds
        except Exception:  # noqa: BLE001 - an agent that cannot load is skipped, not fatal
            ok = False
        if not ok:
            print(f"transfer_cuda: skipping {name!r} (not a registry agent that moves VRAM)", file=sys.stderr)
        elif name not in agents:
            agents.append(name)
    reps = int(getattr(args, "reps", None) or getattr(args, "repeat", None) or 5)
    bad = [f for f in sizes if f <= 0 or total % f]
    if bad:
        raise SystemExit(f"transfer_cuda: fragment sizes {bad} do not divide the total {total} bytes")
    return total, sizes, agents, reps


def _enable_peer_access(dev: int, peer: int) -> None:
    from cuda.bindings import runtime as rt

    rt.cudaSetDevice(dev)
    (err,) = rt.cudaDeviceEnablePeerAccess(peer, 0)
    if int(err) not in (0, int(rt.cudaError_t.cudaErrorPeerAccessAlreadyEnabled)):
        raise RuntimeError(f"cudaDeviceEnablePeerAccess({dev} -> {peer}) failed: {err}")


def run(args=None) -> list[dict]:
    """Run the whole benchmark once; returns the rows (see the module docstring).

    Args:
        args: an argparse namespace or None. Read, each optional: total_mib (int) or total ("1G"); sizes
            (ints, or "4K,16K,..."); agents (names, or "a,b": cuda_ipc always runs, and of the others
            only registry names that move VRAM); reps or repeat (5); memcpy (True); sweep; chunk and
            max_blocks (cuda_ipc tuning).
    """
    import torch

    total, sizes, agents, reps = _options(args)
    if torch.cuda.device_count() < 2:
        raise SystemExit(f"transfer_cuda needs 2 GPUs; this machine has {torch.cuda.device_count()}")
    torch.cuda.set_device(0)
    _enable_peer_access(0, 1)  # the in-process copy-engine baselines go GPU to GPU, not through the host
    peer_proc = PeerProcess(total, agents)
    rows: list[dict] = []
    live = []
    try:
        dst = torch.empty(total, dtype=torch.uint8, device="cuda:0")
        pattern0 = gpu_pattern(total, "cuda:0", SEED).clone()
        src1 = gpu_pattern(total, "cuda:1", SEED).clone()  # in-process source for memcpy_peer
        torch.cuda.synchronize()
        ceiling, ceiling_ok = time_memcpy_peer(dst, src1, pattern0, None, total, 3)
        base = total / ceiling / 1e9
        rows.append(dict(agent="memcpy_peer_1_copy", fragment_bytes=total, fragments=1, gbps=round(base, 1),
                         baseline_gbps=round(base, 1), verified=ceiling_ok, seconds=ceiling))
        opts = {k: getattr(args, k) for k in ("chunk", "max_blocks", "post_chunk") if getattr(args, k, None)}
        if getattr(args, "side_upload", True) is False:
            opts["side_upload"] = False
        connected = _connect_agents(agents, opts, dst, peer_proc, live)
        rng = np.random.default_rng(0)
        if getattr(args, "sweep", False) and "cuda_ipc" in connected:
            rows += sweep(*connected["cuda_ipc"], dst, peer_proc.addr, total, pattern0, rng, sizes)
        for frag in sizes + ([total] if "cuda_ipc" in connected else []):
            case = Case(frag, total, pattern0, rng)
            for kind, (a, name) in connected.items():
                if frag == total and kind != "cuda_ipc":
                    continue
                r = reps if kind == "cuda_ipc" else max(1, min(reps, 2 if frag < (128 << 10) else reps))
                row = _agent_row(kind, a, name, dst, peer_proc.addr, case, r, total, base)
                rows.append(row)
                print(_fmt(row), flush=True)
            if frag < total and getattr(args, "memcpy", True):
                secs, ok = time_memcpy_peer(dst, src1, pattern0, case, total, 1)
                row = dict(agent="memcpy_peer", fragment_bytes=frag, fragments=case.n,
                           gbps=round(total / secs / 1e9, 1), baseline_gbps=round(base, 1), verified=ok,
                           seconds=secs)
                rows.append(row)
                print(_fmt(row), flush=True)
            del case
    finally:
        for a, reg in live:
            reg.release()
            a.close()
        peer_proc.close()
    return rows


def _connect_agents(agents, opts: dict, dst, peer_proc: "PeerProcess", live: list) -> dict:
    """{kind: (local agent, peer name)} for every kind the peer process could make (others are skipped with
    a note); each agent and its registration of `dst` go into `live` at once (the caller releases them)."""
    from kvbridge.agents import MemoryRegion, create_agent

    connected = {}
    for kind in agents:
        meta = peer_proc.metas.get(kind)
        if not isinstance(meta, bytes):
            print(f"skipping {kind}: {meta}", file=sys.stderr)
            continue
        kw = dict(opts, timing=True) if kind == "cuda_ipc" else {}
        a = create_agent(kind, f"bench-local-{kind}-{os.getpid()}", **kw)
        live.append((a, a.register_memory(MemoryRegion.of(dst))))
        name = a.connect(meta)
        peer_proc.connect(kind, a.metadata())
        connected[kind] = (a, name)
    return connected


def _agent_row(kind: str, a, name: str, dst, remote_addr: int, case, reps: int, total: int,
               base: float) -> dict:
    """One agent at one fragment size; cuda_ipc also with its GPU-side time and posted in 8 pieces."""
    secs, gsecs, post, ok = time_agent(a, name, dst, remote_addr, case, reps)
    row = dict(agent=kind, fragment_bytes=case.frag, fragments=case.n, gbps=round(total / secs / 1e9, 1),
               baseline_gbps=round(base, 1), verified=ok, seconds=secs, post_ms=round(post * 1e3, 3))
    if kind == "cuda_ipc":
        row["gpu_gbps"] = round(total / gsecs / 1e9, 1) if gsecs else None
        psecs, _, _, pok = time_agent(a, name, dst, remote_addr, case, reps, pieces=8)
        row["pipelined_gbps"] = round(total / psecs / 1e9, 1)
        row["verified"] = ok and pok
    return row


def sweep(agent, peer: str, dst, remote_addr: int, total: int, pattern0, rng, sizes) -> list[dict]:
    """cuda_ipc kernel variant and launch geometry (bytes per warp item x CTA cap): for tuning defaults."""
    from kvbridge.agents.cuda_ipc import CopyKernel, CopyTuning

    rows, saved = [], agent.tuning
    grid = [CopyTuning(k) for k in CopyKernel]
    grid += [CopyTuning(CopyKernel.ANY, c, b) for c in (4096, 65536) for b in (132, 528)]
    try:
        for frag in sizes:
            case = Case(frag, total, pattern0, rng)
            for tuning in grid:
                agent.tuning = tuning
                rows.append(_sweep_row(agent, peer, dst, remote_addr, total, case, tuning))
            del case
    finally:
        agent.tuning = saved
    return rows


def _sweep_row(agent, peer: str, dst, remote_addr: int, total: int, case, tuning) -> dict:
    kernel, chunk, blocks = tuning.kernel.value, tuning.chunk, tuning.max_blocks
    secs, gsecs, _, ok = time_agent(agent, peer, dst, remote_addr, case, 2)
    row = dict(agent=f"cuda_ipc[{kernel},chunk={chunk},blocks={blocks}]", fragment_bytes=case.frag,
               fragments=case.n, gbps=round(total / secs / 1e9, 1), baseline_gbps=None,
               verified=ok, seconds=secs, gpu_gbps=round(total / gsecs / 1e9, 1), sweep=True)
    print(f"sweep {case.frag >> 10:>5} KiB {kernel} chunk={chunk} blocks={blocks}: "
          f"gpu {row['gpu_gbps']} GB/s, end-to-end {row['gbps']} GB/s, verified={ok}", flush=True)
    return row


def _fmt(row: dict) -> str:
    extra = "".join(f"  {k}={row[k]}" for k in ("post_ms", "gpu_gbps", "pipelined_gbps") if k in row)
    return (f"{row['agent']:<12} {row['fragment_bytes'] >> 10:>8} KiB x {row['fragments']:>7}  "
            f"{row['gbps']:>7.1f} GB/s (ceiling {row['baseline_gbps']:.1f})  "
            f"verified={row['verified']}{extra}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvbridge.bench.transfer_cuda", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the rows (and the environment) to this file")
    p.add_argument("--total-mib", type=int, default=1024)
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")],
                   help="fragment bytes, comma-separated")
    p.add_argument("--agents", type=lambda s: s.split(","), default=["cuda_ipc", "nixl"])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-memcpy", dest="memcpy", action="store_false")
    p.add_argument("--chunk", type=int, help="cuda_ipc: bytes per warp work item")
    p.add_argument("--max-blocks", type=int, help="cuda_ipc: CTAs per launch at most")
    p.add_argument("--post-chunk", type=int, help="cuda_ipc: descriptors per pipelined kernel")
    p.add_argument("--no-side-upload", dest="side_upload", action="store_false",
                   help="cuda_ipc: upload descriptor tables on the kernel's stream (the earlier behaviour)")
    p.add_argument("--sweep", action="store_true", help="cuda_ipc: also time a grid of launch geometries")
    args = p.parse_args(argv)
    rows = run(args)
    if args.json:
        import torch

        env = {"gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
               "torch": torch.__version__, "total_bytes": args.total_mib << 20}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"benchmark": "transfer_cuda", "env": env, "rows": rows}, f, indent=1)
    return 0 if all(r["verified"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
