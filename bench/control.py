"""`kvbridge bench control`: the control plane's own cost per request, on loopback.

This process is one context rank (a real `CacheTransceiver.context` over a pool of position-dependent codes);
G spawned generation ranks (real `CacheTransceiver.generation`, real ZeroMQ, a real agent) pull one-block
requests. For each request the context rank publishes it (the transceiver makes its secret), hands its
disaggregated params to a generation rank (over a pipe: the hop a router would make), and waits for the rank's
own completion (the reader's Done, which the rank answers with DoneAck). The params carry the context block
ids, so the generation rank reads ahead (its reads go out with its Fetch; `--no-read-ahead`: Fetch, Blocks,
then the reads). The owner waits in `check_context_transfer_status` when it has nothing to publish, woken by
the I/O thread (`--owner poll`: it polls every 20 us instead). Two figures per G:

- latency: one request at a time, publish -> complete on the context rank, p50/p90/p99 in microseconds;
- throughput: `--window` requests in flight across the G ranks, completed requests per second.

Every request must end `complete` on the context rank and `ok` on its generation rank (every one of them
reported there), and the context rank must end with nothing pinned; the bench exits 1 otherwise. Each row also
gives the CPU time per request of both sides' processes in the throughput phase (every thread).

    kvbridge bench control [--gens 1,8,64] [--requests 3000] [--window 64] [--agent nixl] [--no-read-ahead]
                           [--owner wait|poll] [--read-poll-us US] [--nixl-progress-us US] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import select
import sys
import time
from dataclasses import dataclass

import numpy as np

from ..formatter.verify import pool_image
from ..errors import DeadlineExceeded
from ..gcheap import freeze_startup_heap
from ..transceiver import CacheTransceiver, DisaggParams, TransceiverConfig
from .common import machine, table, write_json
from .plot import save_plot
from .progress import progress_bar
from .soak_frames import LAY

CTX_SLOTS, GEN_SLOTS, TOKENS = 256, 64, 16  # one block (16 tokens, LAY) per request
POLL_S = 20e-6  # the context rank's owner polls for finished requests this often (it holds no GIL meanwhile)


@dataclass(frozen=True)
class _Req:
    """The request shape CacheTransceiver takes (TensorRT-LLM's LlmRequest fields it reads)."""

    request_id: int
    block_ids: np.ndarray
    num_tokens: int
    disagg_params: object = None


def _config(agent: str, tweaks: dict | None = None) -> TransceiverConfig:
    us = (tweaks or {}).get("nixl_progress_us")
    options = {} if us is None else {"nixl": {"progress_interval_s": us * 1e-6}}
    return TransceiverConfig(agents=(agent,), heartbeat_s=0.5, lease_s=10.0, pickup_timeout_s=60.0, options=options)


def _gen_main(conn, agent: str, tweaks: dict | None = None) -> None:
    """One generation rank: submit every (rid, params dict, slot) it is handed; report failures at the end."""
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    if (tweaks or {}).get("read_poll_us") is not None:  # an experiment: the pause between looks at reads
        from ..transceiver import receiver

        receiver._READ_POLL_S = tweaks["read_poll_us"] * 1e-6
    buf = pool_image(LAY, 0, GEN_SLOTS, [], 9).copy()
    failed: list[tuple[int, str]] = []
    timings: list[dict[str, float]] = []  # each pull's own timings, summed up only when "stats" asks
    ok = 0

    def reap(results) -> int:
        for r in results:
            if not r.ok:
                failed.append((r.request_id, f"{r.error_type}: {r.error}"))
            timings.append(r.timings_ms)
        return sum(r.ok for r in results)

    def medians() -> dict[str, float]:
        keys = {k for t in timings for k in t}
        return {k: float(np.median([t[k] for t in timings if k in t])) for k in keys}

    with CacheTransceiver.generation(buf, LAY, 0, GEN_SLOTS, _config(agent, tweaks)) as gen:
        freeze_startup_heap()  # as a serving process does once ready (`gcheap`)
        conn.send(gen.instance)
        pipe = select.poll()  # made once: conn.poll() builds a selector per call (~5% of this process's GIL time)
        pipe.register(conn.fileno(), select.POLLIN)
        while True:
            if pipe.poll(10):  # submit at once; reaping results later costs the context rank nothing
                msg = conn.recv()
                if msg is None:
                    break
                if msg == "stats":  # medians of the pulls' own timings since the last "stats", and CPU used
                    ok += reap(gen.check_gen_transfer_status(0))
                    cpu = time.process_time()  # before the medians: their sums are no request's cost
                    conn.send({**medians(), "process_cpu_s": cpu})
                    timings.clear()
                    continue
                rid, params, slot = msg
                gen.request_and_receive_async(_Req(rid, np.array([slot]), TOKENS, params))
            ok += reap(gen.check_gen_transfer_status())
        ok += reap(gen.check_gen_transfer_status())
        stop = time.monotonic() + 30  # pulls whose DoneAck is on its way (the context rank finished first)
        while gen.receiver.in_flight and time.monotonic() < stop:
            try:
                ok += reap(gen.check_gen_transfer_status(1, 0.05))
            except DeadlineExceeded:
                pass
        ok += reap(gen.check_gen_transfer_status())
        conn.send({"ok": ok, "failed": failed[:10], "failed_count": len(failed)})


class _ContextRank:
    """The context rank under test and the generation ranks it serves."""

    def __init__(self, gens: int, agent: str, read_ahead: bool = True, owner: str = "wait",
                 tweaks: dict | None = None) -> None:
        self.read_ahead, self.owner = read_ahead, owner
        blocks = [([s], TOKENS, s + 1) for s in range(CTX_SLOTS)]
        self.buf = pool_image(LAY, 0, CTX_SLOTS, blocks, 1).copy()
        self.ctx = CacheTransceiver.context(self.buf, LAY, 0, CTX_SLOTS, _config(agent, tweaks))
        spawn = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for _ in range(gens):
            a, b = spawn.Pipe()
            extra = () if not tweaks else (tweaks,)
            p = spawn.Process(target=_gen_main, args=(b, agent, *extra), daemon=True)
            p.start()
            self.conns.append(a)
            self.procs.append(p)
        for c in self.conns:
            if not c.poll(120):
                raise TimeoutError("a generation rank did not start within 120 s")
            c.recv()
        freeze_startup_heap()  # as a serving process does once ready (`gcheap`); undone at close
        self.next_rid, self.t_pub, self.done = 1, {}, {}
        self.status: dict[str, int] = {}

    def publish(self, gen: int) -> None:
        rid, slot = self.next_rid, self.next_rid % CTX_SLOTS
        self.next_rid += 1
        self.t_pub[rid] = time.perf_counter()
        secret = self.ctx.respond_and_send_async(_Req(rid, np.array([slot]), TOKENS))
        params = DisaggParams(rid, self.ctx.instance, (self.ctx.endpoint,), LAY, secret,
                              (slot,) if self.read_ahead else None).to_dict()
        self.conns[gen].send((rid, params, rid % GEN_SLOTS))

    def reap(self, block: bool) -> int:
        """Take finished requests. With nothing to publish (`block`) a waiting owner sleeps in
        check_context_transfer_status until one finishes; a polling one looks every POLL_S."""
        got = self.ctx.check_context_transfer_status()
        if not got and block and self.owner == "wait":
            try:
                got = self.ctx.check_context_transfer_status(1, timeout_s=0.05)
            except DeadlineExceeded:
                got = []
        elif not got and self.owner == "poll":
            time.sleep(POLL_S)  # an engine polls between steps; a tight spin would starve the I/O thread
        now = time.perf_counter()
        for r in got:
            self.done[r.ctx_request_id] = now - self.t_pub.pop(r.ctx_request_id)
            self.status[r.status] = self.status.get(r.status, 0) + 1
        return len(got)

    def run(self, n: int, window: int, deadline_s: float, tick=None) -> float:
        """Publish n requests keeping `window` in flight; seconds from the first publish to the last completion."""
        t0, gen, finished = time.perf_counter(), 0, 0
        stop = time.monotonic() + deadline_s
        while finished < n:
            while len(self.t_pub) < window and self.next_rid - 1 - self._base < n:
                self.publish(gen)
                gen = (gen + 1) % len(self.conns)
            got = self.reap(len(self.t_pub) >= window or self.next_rid - 1 - self._base >= n)
            finished += got
            if tick and got:
                tick(got)
            if time.monotonic() > stop:
                raise TimeoutError(f"{finished} of {n} requests completed within {deadline_s:g} s")
        return time.perf_counter() - t0

    def measure(self, n: int, window: int, deadline_s: float, tick=None) -> tuple[np.ndarray, float]:
        self._base, self.done = self.next_rid - 1, {}
        seconds = self.run(n, window, deadline_s, tick)
        return np.array(list(self.done.values())) * 1e6, seconds

    def gen_timings(self) -> dict:
        """Median per-stage times (ms) the generation ranks' pulls reported since the last call (rank 0)."""
        for c in self.conns:
            c.send("stats")
        got = [c.recv() if c.poll(30) else {} for c in self.conns]
        self.gen_cpu_s = sum(g.get("process_cpu_s", 0.0) for g in got)  # every generation process's CPU so far
        return {k: round(v, 4) for k, v in got[0].items() if k != "process_cpu_s"}

    def close(self) -> dict:
        reports = []
        for c in self.conns:
            c.send(None)
        for c in self.conns:
            reports.append(c.recv() if c.poll(60) else {"ok": 0, "failed": [(-1, "no report")],
                                                         "failed_count": 1})
        for p in self.procs:
            p.join(20)
            if p.is_alive():
                p.kill()
        pinned = self.ctx.sender.pinned
        self.ctx.close()
        gc.unfreeze()  # the next rank count's context rank freezes its own heap (this one's cycles collectable)
        return {"gen_ok": sum(r["ok"] for r in reports), "gen_failed": sum(r["failed_count"] for r in reports),
                "errors": [e for r in reports for e in r["failed"]][:10], "ctx_pinned_at_end": pinned}


def bench_gens(gens: int, args) -> dict:
    tweaks = {k: v for k, v in (("read_poll_us", args.read_poll_us), ("nixl_progress_us", args.nixl_progress_us))
              if v is not None}
    rank = _ContextRank(gens, args.agent, not args.no_read_ahead, args.owner, tweaks)
    try:
        rank.measure(min(200, args.requests), min(args.window, 8), 120)  # warm-up: connections, handshakes
        with progress_bar(args.requests * 2, f"{gens} gen ranks") as bar:
            rank.gen_timings()
            lat, _ = rank.measure(args.requests, 1, 600, bar.update)
            stages = rank.gen_timings()
            gen0, ctx0 = rank.gen_cpu_s, time.process_time()
            lat_w, seconds = rank.measure(args.requests, args.window, 600, bar.update)
            ctx_cpu = time.process_time() - ctx0
            rank.gen_timings()
            gen_cpu = rank.gen_cpu_s - gen0
    finally:
        end = rank.close()
    ok = (end["gen_failed"] == 0 and end["ctx_pinned_at_end"] == 0 and end["gen_ok"] == rank.next_rid - 1
          and set(rank.status) == {"complete"})
    return {"gen_ranks": gens, "agent": args.agent, "read_ahead": not args.no_read_ahead, "owner": args.owner,
            "read_poll_us": args.read_poll_us, "nixl_progress_us": args.nixl_progress_us,
            "requests": args.requests, "window": args.window,
            "p50_us": float(np.percentile(lat, 50)), "p90_us": float(np.percentile(lat, 90)),
            "p99_us": float(np.percentile(lat, 99)),
            "p50_us_loaded": float(np.percentile(lat_w, 50)), "p99_us_loaded": float(np.percentile(lat_w, 99)),
            "req_per_s": args.requests / seconds, "gen_stages_p50_ms": stages,
            # CPU time per request under load (every thread: owner, I/O, ZeroMQ, NIXL), both sides' processes
            "gen_cpu_us_per_req": gen_cpu / args.requests * 1e6, "ctx_cpu_us_per_req": ctx_cpu / args.requests * 1e6,
            "ctx_status": rank.status, **end, "verified": ok}


def plot(rows: list[dict], path: str) -> None:
    def draw(fig):
        ax1, ax2 = fig.subplots(1, 2)
        g = [str(r["gen_ranks"]) for r in rows]
        x = np.arange(len(rows))
        ax1.bar(x - 0.2, [r["p50_us"] for r in rows], 0.4, label="p50")
        ax1.bar(x + 0.2, [r["p99_us"] for r in rows], 0.4, label="p99")
        ax1.axhline(150, color="grey", ls="--", lw=1, label="goal p50 150 us")
        ax1.set(xticks=x, xticklabels=g, xlabel="generation ranks", ylabel="publish -> complete (us)",
                title="latency, one request at a time")
        ax1.legend()
        ax2.bar(x, [r["req_per_s"] for r in rows])
        ax2.axhline(5000, color="grey", ls="--", lw=1, label="goal 5,000 req/s")
        ax2.set(xticks=x, xticklabels=g, xlabel="generation ranks", ylabel="requests / s",
                title=f"throughput, {rows[0]['window']} in flight")
        ax2.legend()

    save_plot(path, draw, f"control plane, one context rank, agent {rows[0]['agent']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvbridge bench control", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gens", default="1,8,64", help="generation rank counts to run")
    ap.add_argument("--requests", type=int, default=3000, help="requests per measurement")
    ap.add_argument("--window", type=int, default=64, help="requests in flight for the throughput figure")
    ap.add_argument("--agent", default="nixl", help="the transfer agent (registry name)")
    ap.add_argument("--no-read-ahead", action="store_true",
                    help="leave the context block ids out of DisaggParams: Fetch, Blocks, then the reads")
    ap.add_argument("--owner", choices=["wait", "poll"], default="wait",
                    help="how the context rank's owner learns of completions: blocked in "
                         "check_context_transfer_status (woken by the I/O thread), or polling every 20 us")
    ap.add_argument("--read-poll-us", type=float, default=None,
                    help="experiment: the generation ranks' pause between looks at reads in flight (0: spin; "
                         "default: the receiver's own, 50 us)")
    ap.add_argument("--nixl-progress-us", type=float, default=None,
                    help="experiment: the NIXL agents' progress-thread period on both sides (default: the "
                         "agent's own, 500 us)")
    ap.add_argument("--json", help="write the rows as JSON here (and a PNG plot beside it)")
    args = ap.parse_args(argv)
    print(f"# control plane on loopback, one-block requests, agent {args.agent}; {machine()}", flush=True)
    rows = [bench_gens(int(g), args) for g in args.gens.split(",")]
    cols = ["gen_ranks", "p50_us", "p90_us", "p99_us", "p50_us_loaded", "req_per_s", "gen_cpu_us_per_req",
            "ctx_cpu_us_per_req", "gen_failed",
            "ctx_pinned_at_end", "verified"]
    print(table(rows, cols))
    write_json(args.json, rows)
    if args.json:
        plot(rows, os.path.splitext(args.json)[0] + ".png")
    return 0 if all(r["verified"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
