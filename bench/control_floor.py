"""The floor under `kvbridge bench control`: what one message between two processes costs with no kvbridge in it.

One request of `bench control` crosses processes at least three times one way (the params to the generation
rank over a pipe, the Fetch to the context rank and the Done back, over ZeroMQ; with read-ahead the Fetch and
the reads overlap). This measures those hops bare, one message in flight, 64-byte payloads, between this
process and one child:

- `pipe`: multiprocessing.Pipe (the bench's router hop), blocking recv;
- `zmq_ipc` / `zmq_tcp`: pyzmq DEALER <-> ROUTER over ipc:// and tcp://127.0.0.1 (what the transceiver uses),
  blocking recv (`block`) or a recv(NOBLOCK) loop that never sleeps (`spin`, a core per side).

Each row: round-trip p50/p90 in microseconds (one way is half). `--idle-us N` pauses N us before each round
(both sides idle, as between one-at-a-time requests): the difference to 0 is what waking an idle thread (and
core) costs on that host. A control plane built on these hops cannot be
faster than ~1.5 round trips of them per request; `bench/RESULTS.md` compares.

    python -m kvbridge.bench.control_floor [--rounds 3000] [--idle-us 0] [--json PATH] [--png PATH]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time

import numpy as np

from .common import finish, machine, output_args, table
from .plot import p50_p90_bars

PAYLOAD = b"x" * 64


def _recv(sock, spin: bool):
    import zmq

    if not spin:
        return sock.recv_multipart()
    while True:
        try:
            return sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            pass


def _zmq_echo(addr: str, spin: bool) -> None:
    import zmq

    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(addr)
    s.send(b"hello")
    while True:
        (m,) = _recv(s, spin)
        if m == b"stop":
            break
        s.send(m)
    s.close()
    ctx.term()


def _pipe_echo(conn) -> None:
    while True:
        m = conn.recv_bytes()
        if m == b"stop":
            break
        conn.send_bytes(m)


def _idle(us: float) -> None:
    """Pause `us` microseconds without a spin (time.sleep sleeps at least that long on Linux)."""
    if us > 0:
        time.sleep(us * 1e-6)


def _zmq_rtt(addr: str, spin: bool, rounds: int, idle_us: float = 0.0) -> np.ndarray:
    import zmq

    ctx = zmq.Context()
    r = ctx.socket(zmq.ROUTER)
    r.setsockopt(zmq.LINGER, 0)
    r.setsockopt(zmq.RCVTIMEO, 30_000)  # a child that died must not hang the bench
    if addr.endswith(":0"):  # tcp: a free port
        addr = f"tcp://127.0.0.1:{r.bind_to_random_port('tcp://127.0.0.1')}"
    else:
        r.bind(addr)
    p = mp.get_context("spawn").Process(target=_zmq_echo, args=(addr, spin), daemon=True)
    p.start()
    try:
        ident, _ = r.recv_multipart()
        out = np.empty(rounds)
        for i in range(rounds):
            _idle(idle_us)
            t = time.perf_counter()
            r.send_multipart([ident, PAYLOAD])
            _recv(r, spin)
            out[i] = time.perf_counter() - t
        r.send_multipart([ident, b"stop"])
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()
        r.close()
        ctx.term()
    return out


def _pipe_rtt(rounds: int, idle_us: float = 0.0) -> np.ndarray:
    a, b = mp.Pipe()
    p = mp.get_context("spawn").Process(target=_pipe_echo, args=(b,), daemon=True)
    p.start()
    try:
        out = np.empty(rounds)
        for i in range(rounds):
            _idle(idle_us)
            t = time.perf_counter()
            a.send_bytes(PAYLOAD)
            if not a.poll(30):
                raise RuntimeError("the pipe's echo process did not answer within 30 s")
            a.recv_bytes()
            out[i] = time.perf_counter() - t
        a.send_bytes(b"stop")
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()
    return out


def run(rounds: int, idle_us: float = 0.0) -> list[dict]:
    warm = max(1, rounds // 5)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvb-floor-") as d:
        cases = [("pipe", "block", lambda: _pipe_rtt(rounds + warm, idle_us))]
        for spin in (False, True):
            mode = "spin" if spin else "block"
            ipc = f"ipc://{os.path.join(d, 'f.sock')}"
            cases += [("zmq_ipc", mode, lambda s=spin: _zmq_rtt(ipc, s, rounds + warm, idle_us)),
                      ("zmq_tcp", mode, lambda s=spin: _zmq_rtt("tcp://127.0.0.1:0", s, rounds + warm, idle_us))]
        for hop, mode, fn in cases:
            us = fn()[warm:] * 1e6
            rows.append({"hop": hop, "wait": mode, "idle_us": idle_us, "rtt_p50_us": round(float(np.median(us)), 1),
                         "rtt_p90_us": round(float(np.percentile(us, 90)), 1), "rounds": rounds})
            print(table(rows[-1:], list(rows[-1])), flush=True)
    return rows


def _png(path: str, rows: list[dict]) -> None:
    p50_p90_bars(path, [f"{r['hop']}\n{r['wait']}" for r in rows], [r["rtt_p50_us"] for r in rows],
                 [r["rtt_p90_us"] for r in rows], "round trip, us",
                 f"control_floor: bare round trips between two processes ({machine()[:50]})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvbridge.bench.control_floor", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3000, help="round trips per row (after a fifth as warm-up)")
    ap.add_argument("--idle-us", type=float, default=0.0, help="pause before each round (both sides idle)")
    output_args(ap)
    a = ap.parse_args(argv)
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    if not 0 <= a.idle_us <= 1e6:
        ap.error("--idle-us must be between 0 and 1000000")
    finish(run(a.rounds, a.idle_us), a, _png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
