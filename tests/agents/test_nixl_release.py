"""NIXL transfer handles their owner never released: freed by the garbage collector without a crash, and
settled (FAILED, released) when their agent closes. Real UCX against a peer process.

    collected in a cycle    NIXL's request object releases itself when collected, without noting it; a
                            kvbridge handle collected in the same cycle released it a second time and the
                            process died (SIGSEGV; found when a receiver closed with reads in flight was
                            collected). Run in a child process, so a crash fails this test, not the suite.
    agent closed under it   a handle still pending when its agent closes reads FAILED (it read PENDING for
                            ever) and holds no NIXL request any more; releasing it later does nothing
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

from kvbridge.agents import MemoryRegion, XferState, create_agent
from kvbridge.agents.base import DescriptorList
from kvbridge.agents.conformance.peer import Peer, alloc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N = 1 << 16

CHILD = f"""
import gc, os, warnings
warnings.simplefilter("ignore")
from kvbridge.agents import MemoryRegion, create_agent
from kvbridge.agents.base import DescriptorList
from kvbridge.agents.conformance.peer import Peer, alloc
peer = Peer("nixl", {N}, "cpu", seed=5)
a = create_agent("nixl", f"gc-{{os.getpid()}}")
buf = alloc({N}, "cpu", seed=1)
reg = a.register_memory(MemoryRegion.of(buf))
name = a.connect(peer.metadata)
for _ in range(50):
    h = a.read(name, DescriptorList([buf.ctypes.data], [{N}]), DescriptorList([peer.addr], [{N}]))
    h.wait(10)
    h.cycle = [h]  # unreleased, in a cycle: only the garbage collector frees it
    del h
gc.collect()
print("survived", flush=True)
reg.release()
a.close()
peer.close()
"""


def test_unreleased_handles_collected_in_a_cycle_do_not_crash_the_process():
    env = {**os.environ, "PYTHONPATH": os.path.dirname(ROOT), "UCX_LOG_LEVEL": "error"}
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and "survived" in r.stdout, (r.returncode, r.stdout[-500:], r.stderr[-1500:])


def test_a_handle_pending_when_its_agent_closes_reads_failed_and_holds_nothing():
    peer = Peer("nixl", N, "cpu", seed=5)
    a = create_agent("nixl", f"close-{os.getpid()}")
    try:
        buf = alloc(N, "cpu", seed=1)
        reg = a.register_memory(MemoryRegion.of(buf))
        name = a.connect(peer.metadata)
        # posted, never progressed or released by its owner (a transceiver closed mid-read)
        hs = [a.read(name, DescriptorList([buf.ctypes.data], [N]), DescriptorList([peer.addr], [N]))
              for _ in range(4)]
        a.close()
        assert all(h.state() in (XferState.FAILED, XferState.DONE) for h in hs)  # settled, not PENDING
        assert all(h._xfer is None for h in hs)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for h in hs:
                h.release()  # nothing left to release: no error, no warning
        reg.release()
    finally:
        a.close()
        peer.close()
