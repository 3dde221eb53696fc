"""Bounded per-peer state: 20,000 connect / Hello / disconnect cycles leave a context rank as they found it.

The context rank is a real process (ranks.RankProc); the peers are real ZeroMQ DEALER sockets, a hundred at
a time, each with its own identity, each completing the handshake (Welcome received) before it goes away. RSS
is compared after a warm-up (allocator arenas and zmq's per-connection buffers reach their high-water mark).
"""

from __future__ import annotations

import time

import pytest
import zmq

from kvbridge.formatter.layout import KVLayout, KVShape
from kvbridge.transceiver import messages as m

from .ranks import RankProc

LAYOUT = KVLayout(KVShape(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", tokens_per_block=16))
# max_sessions above what a batch-of-100 churn can open within one peer_timeout on a quiet machine (the bound
# itself, refusing the session beyond it, is test_security's): here every cycle must complete its handshake
CFG = {"agents": ["nixl"], "peer_timeout_s": 0.5, "max_sessions": 16384}
CYCLES, BATCH = 20_000, 100


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _cycles(zctx: zmq.Context, endpoint: str, n: int) -> int:
    """n connect / Hello / Welcome / disconnect cycles, BATCH peers at a time; returns Welcomes received."""
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
    zctx = zmq.Context()  # its own: other tests' sockets do not count against its max_sockets
    zctx.max_sockets = 4096  # closed sockets count until zmq's reaper is done with them
    try:
        ep = p.call("init", {"role": "context", "layout": LAYOUT.to_wire(), "rank": 0, "num_blocks": 8,
                             "config": CFG, "instance": "ctx-churn"})
        start = _sessions(p)
        # warm-up: allocator arenas and zmq's per-connection structures reach their high-water mark
        assert _cycles(zctx, ep, 5000) == 5000
        assert _wait_sessions(p, start, CFG["peer_timeout_s"] + 10) == start
        rss = [_rss_kb(p.proc.pid)]
        t0 = time.monotonic()
        peak = 0
        for _ in range(2):
            assert _cycles(zctx, ep, CYCLES // 2) == CYCLES // 2
            peak = max(peak, _sessions(p))
            assert _wait_sessions(p, start, CFG["peer_timeout_s"] + 10) == start  # every session dropped again
            rss.append(_rss_kb(p.proc.pid))
        took = time.monotonic() - t0
        growth_mb = (rss[-1] - rss[0]) / 1024
        print(f"{CYCLES} cycles in {took:.1f} s; sessions {start} -> {peak} (seen) -> {_sessions(p)}; context "
              f"rank RSS {' -> '.join(f'{r / 1024:.1f}' for r in rss)} MB: {growth_mb:+.2f} MB")
        assert growth_mb < 8, f"context rank grew by {growth_mb:.1f} MB over {CYCLES} cycles"
    finally:
        zctx.destroy(0)
        p.close()
