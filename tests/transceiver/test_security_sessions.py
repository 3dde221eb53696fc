"""Bounded per-peer state: 20,000 connect / Hello / disconnect cycles leave a context rank as they found it.

The context rank is a real process (ranks.RankProc); the peers are real ZeroMQ DEALER sockets, a few hundred
at a time, each with its own identity, each completing the handshake (Welcome received) before it goes away.
"""

from __future__ import annotations

import time

import pytest
import zmq

from kvbridge.formatter.layout import KVLayout, KVShape
from kvbridge.transceiver import messages as m

from .ranks import RankProc

LAYOUT = KVLayout(KVShape(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", tokens_per_block=16))
CFG = {"agents": ["nixl"], "peer_timeout_s": 1.0, "max_sessions": 4096}
CYCLES, BATCH = 20_000, 400


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _cycles(endpoint: str, n: int) -> int:
    """n connect / Hello / Welcome / disconnect cycles, BATCH peers at a time; returns Welcomes received."""
    zctx = zmq.Context.instance()
    hello = m.Hello("churn", 0, LAYOUT.to_wire(), ["nixl"]).encode()
    welcomed = 0
    for start in range(0, n, BATCH):
        socks = []
        for _ in range(min(BATCH, n - start)):
            s = zctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(endpoint)
            s.send(hello)
            socks.append(s)
        for s in socks:
            if s.poll(20000) and isinstance(m.decode(s.recv()), m.Welcome):
                welcomed += 1
            s.close()
    return welcomed


def _sessions(p: RankProc) -> int:
    return p.call("ctx_status")["sessions"]


def _wait_sessions(p: RankProc, want: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while (n := _sessions(p)) != want and time.monotonic() < deadline:
        time.sleep(0.1)
    return n


@pytest.mark.slow
def test_twenty_thousand_hello_disconnect_cycles_leave_sessions_and_memory_where_they_started():
    p = RankProc()
    try:
        ep = p.call("init", {"role": "context", "layout": LAYOUT.to_wire(), "rank": 0, "num_blocks": 8,
                             "config": CFG, "instance": "ctx-churn"})
        start = _sessions(p)
        assert _cycles(ep, 2000) == 2000  # warm-up: allocator arenas, zmq pipes, import-time caches
        assert _wait_sessions(p, start, CFG["peer_timeout_s"] + 10) == start
        rss0 = _rss_kb(p.proc.pid)
        t0 = time.monotonic()
        assert _cycles(ep, CYCLES) == CYCLES
        took = time.monotonic() - t0
        peak = _sessions(p)
        assert _wait_sessions(p, start, CFG["peer_timeout_s"] + 10) == start  # every session dropped again
        growth_mb = (_rss_kb(p.proc.pid) - rss0) / 1024
        print(f"{CYCLES} cycles in {took:.1f} s; sessions {start} -> {peak} (peak seen) -> {_sessions(p)}; "
              f"context rank RSS growth {growth_mb:+.2f} MB")
        assert growth_mb < 8, f"context rank grew by {growth_mb:.1f} MB over {CYCLES} cycles"
    finally:
        p.close()
