"""What posting one small NIXL READ costs the caller's thread: NIXL's own calls, and kvbridge's NixlAgent.read.

Two NIXL agents in this process (host memory, UCX), one 4 KiB descriptor per READ, each READ waited for and
released before the next; per READ, the median over `--reads` of:

- `nixl_descs_us` + `nixl_init_us` + `nixl_post_us`: NIXL's Python API as kvbridge calls it (two descriptor
  lists, `initialize_xfer`, `transfer`);
- `nixl_prepped_us` + `nixl_post_us`: the alternative of descriptor lists prepared once (`prep_xfer_dlist`)
  and a transfer made from indices (`make_prepped_xfer`), as vLLM's NixlConnector does;
- `kvbridge_read_us`: `NixlAgent.read(peer, local, remote)` through kvbridge's public API (the descriptor
  lists made by the caller, checks, NIXL's calls above).

The question it answers: what preparing transfers once per peer would take off a control-plane request
(`kvbridge bench control`'s one-block reads post one such READ each).

    python -m kvbridge.bench.nixl_post [--reads 3000] [--json bench/results/nixl_post.json]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from .common import machine, table, write_json

SIZE = 4096
SLOTS = 256


def _wait(handle_state, progress, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while handle_state() != "DONE":
        progress()
        if time.monotonic() > deadline:
            raise TimeoutError("a 4 KiB NIXL READ did not finish within 5 s")


def measure(reads: int) -> dict:
    from kvbridge.agents import DescriptorList, MemoryRegion, XferState
    from kvbridge.agents.nixl_agent import NixlAgent

    a, b = NixlAgent(f"post-a-{time.monotonic_ns()}"), NixlAgent(f"post-b-{time.monotonic_ns()}")
    mine = np.zeros(SIZE * SLOTS, np.uint8)
    theirs = (np.arange(SIZE * SLOTS, dtype=np.int64) % 251).astype(np.uint8)
    try:
        regs = [a.register_memory(MemoryRegion.of(mine)), b.register_memory(MemoryRegion.of(theirs))]  # kept
        peer = a.connect(b.metadata())
        b.connect(a.metadata())
        covered = min(reads + 100, SLOTS) * SIZE

        def check() -> None:  # after each way of posting: the slots it read hold the peer's bytes; then cleared
            if not np.array_equal(mine[:covered], theirs[:covered]):
                raise RuntimeError("the READs did not copy the peer's bytes exactly")
            mine[:] = 0

        nx = a._nx  # the native agent: NIXL's own calls, timed beside kvbridge's
        la, ra = mine.ctypes.data, theirs.ctypes.data
        t = {k: [] for k in ("nixl_descs_us", "nixl_init_us", "nixl_post_us", "nixl_prepped_us", "kvbridge_read_us")}
        for i in range(reads + 100):  # the first 100 warm up (connections, allocator)
            k = i % SLOTS
            t0 = time.perf_counter()
            ld, rd = nx.get_xfer_descs([(la + k * SIZE, SIZE, 0)], "DRAM"), nx.get_xfer_descs(
                [(ra + k * SIZE, SIZE, 0)], "DRAM")
            t1 = time.perf_counter()
            x = nx.initialize_xfer("READ", ld, rd, peer)
            t2 = time.perf_counter()
            nx.transfer(x)
            t3 = time.perf_counter()
            _wait(lambda: nx.check_xfer_state(x), b.progress)
            nx.release_xfer_handle(x)
            if i >= 100:
                t["nixl_descs_us"].append(t1 - t0)
                t["nixl_init_us"].append(t2 - t1)
                t["nixl_post_us"].append(t3 - t2)
        check()
        lp = nx.prep_xfer_dlist("NIXL_INIT_AGENT", [(la + k * SIZE, SIZE, 0) for k in range(SLOTS)], "DRAM")
        rp = nx.prep_xfer_dlist(peer, [(ra + k * SIZE, SIZE, 0) for k in range(SLOTS)], "DRAM")
        for i in range(reads + 100):
            k = i % SLOTS
            t0 = time.perf_counter()
            x = nx.make_prepped_xfer("READ", lp, [k], rp, [k])
            t1 = time.perf_counter()
            nx.transfer(x)
            _wait(lambda: nx.check_xfer_state(x), b.progress)
            nx.release_xfer_handle(x)
            if i >= 100:
                t["nixl_prepped_us"].append(t1 - t0)
        check()
        for i in range(reads + 100):
            k = i % SLOTS
            one = np.array([SIZE], np.int64)
            local, remote = DescriptorList([la + k * SIZE], one), DescriptorList([ra + k * SIZE], one)
            t0 = time.perf_counter()
            h = a.read(peer, local, remote)
            t1 = time.perf_counter()
            _wait(lambda: "DONE" if h.state() is XferState.DONE else "", b.progress)
            h.release()
            if i >= 100:
                t["kvbridge_read_us"].append(t1 - t0)
        check()
        for r in regs:
            r.release()
    finally:
        a.close()
        b.close()
    row = {k: round(float(np.median(v)) * 1e6, 2) for k, v in t.items()}
    row.update(reads=reads, bytes=SIZE, verified=True, host=machine())
    return row


def plot(row: dict, path: str) -> None:
    from .plot import save_plot

    def draw(fig):
        ax = fig.add_subplot(1, 1, 1)
        bars = [("NIXL: descs + init + post", [row["nixl_descs_us"], row["nixl_init_us"], row["nixl_post_us"]]),
                ("NIXL: prepped + post", [0.0, row["nixl_prepped_us"], row["nixl_post_us"]]),
                ("kvbridge NixlAgent.read", [0.0, 0.0, row["kvbridge_read_us"]])]
        for y, (name, parts) in enumerate(bars):
            left = 0.0
            for part, colour in zip(parts, ("#9ecae1", "#4292c6", "#08519c")):
                ax.barh(y, part, left=left, color=colour)
                left += part
            ax.text(left, y, f" {left:.1f} us", va="center")
        ax.set_yticks(range(len(bars)), [b[0] for b in bars])
        ax.set_xlabel("us per 4 KiB READ posted (median)")

    save_plot(path, draw, f"Posting one small NIXL READ, host memory ({row['host']})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvbridge.bench.nixl_post", description=__doc__.split("\n\n")[0])
    ap.add_argument("--reads", type=int, default=3000)
    ap.add_argument("--json", default=None, help="rows as JSON (+ a PNG beside it)")
    args = ap.parse_args(argv)
    row = measure(args.reads)
    print(table([row], list(row)))
    if args.json:
        write_json(args.json, [row])
        plot(row, args.json.rsplit(".", 1)[0] + ".png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
