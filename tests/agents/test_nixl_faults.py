"""The NIXL agent under faults (the connection agents have theirs in test_connection_faults.py): a peer process
killed between transfers, then a fresh peer. Real processes, real UCX; the only fault is the kill."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from kvbridge.agents import MemoryRegion, create_agent
from kvbridge.agents.base import DescriptorList
from kvbridge.errors import AgentError, PeerError

from kvbridge.agents.conformance.peer import Peer, alloc, pattern

NBYTES = 1 << 20


def _whole(owner_addr: int) -> DescriptorList:
    return DescriptorList([owner_addr], [NBYTES])


def test_a_killed_nixl_peer_fails_the_next_read_at_once_and_the_agent_serves_a_new_peer():
    peer = Peer("nixl", NBYTES, "cpu", seed=3)
    agent = create_agent("nixl", f"nixl-faults-{os.getpid()}")
    buf = alloc(NBYTES, "cpu", seed=11)
    reg = agent.register_memory(MemoryRegion.of(buf))
    fresh = None
    try:
        name = agent.connect(peer.metadata)
        with agent.read(name, _whole(buf.ctypes.data), _whole(peer.addr)) as h:
            h.wait(30)  # the endpoint is up
        np.testing.assert_array_equal(buf, pattern(NBYTES, 3))
        peer.proc.kill()
        peer.proc.join(10)
        t0 = time.monotonic()
        with pytest.raises(AgentError, match=f"{name}.*(REMOTE_DISCONNECT|peer gone)"):
            h = agent.read(name, _whole(buf.ctypes.data), _whole(peer.addr))  # refused at post, or ...
            try:
                h.wait(30)  # ... failed by NIXL: either way within seconds, not at a timeout
            finally:
                h.release()
        assert time.monotonic() - t0 < 10
        agent.disconnect(name)
        with pytest.raises(PeerError, match="not connected"):
            agent.read(name, _whole(buf.ctypes.data), _whole(peer.addr))
        fresh = Peer("nixl", NBYTES, "cpu", seed=4)
        name = agent.connect(fresh.metadata)
        with agent.read(name, _whole(buf.ctypes.data), _whole(fresh.addr)) as h:
            h.wait(30)
        np.testing.assert_array_equal(buf, pattern(NBYTES, 4))  # every byte of the new peer's buffer
    finally:
        reg.release()
        agent.close()
        if fresh is not None:
            fresh.close()
