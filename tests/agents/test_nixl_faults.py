"""The NIXL agent under faults (the connection agents have theirs in test_connection_faults.py): a peer
process killed between transfers, then a fresh peer; a peer that goes silent (SIGSTOP) under a read, which is
then cancelled. Real processes, real UCX; the only fault is the kill or the stop. (Cancel of a running read
and a dead peer in general: the conformance suite's cancel and peer-dies checks, run on NIXL by
test_conformance.)"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from kvbridge.agents import MemoryRegion, XferState, create_agent
from kvbridge.agents.base import DescriptorList
from kvbridge.errors import AgentError, PeerError, TransferTimeout

from kvbridge.agents.conformance.peer import Peer, alloc, pattern

from ..signals import wait_stopped

NBYTES = 1 << 20


def _whole(owner_addr: int) -> DescriptorList:
    return DescriptorList([owner_addr], [NBYTES])


def _connect_and_read(agent, peer: Peer, buf: np.ndarray, seed: int) -> str:
    """Connect to `peer`, read its whole buffer once (the endpoint is up) and check every byte; its name."""
    name = agent.connect(peer.metadata)
    with agent.read(name, _whole(buf.ctypes.data), _whole(peer.addr)) as h:
        h.wait(30)
    np.testing.assert_array_equal(buf, pattern(NBYTES, seed))
    return name


def test_a_killed_nixl_peer_fails_the_next_read_at_once_and_the_agent_serves_a_new_peer():
    peer = Peer("nixl", NBYTES, "cpu", seed=3)
    agent = create_agent("nixl", f"nixl-faults-{os.getpid()}")
    buf = alloc(NBYTES, "cpu", seed=11)
    reg = agent.register_memory(MemoryRegion.of(buf))
    fresh = None
    try:
        name = _connect_and_read(agent, peer, buf, 3)
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


def test_a_silent_nixl_peer_keeps_its_read_pending_and_a_cancel_fails_it_once_the_peer_is_back(monkeypatch):
    """Over UCX's tcp transport a READ needs the peer's progress (shared memory would read a stopped
    process's pages one-sided and finish DONE, which is right too): a SIGSTOPped peer leaves the read PENDING
    with no byte landed, wait() gives up at its own bound, cancel() cannot stop it, and it ends FAILED (never
    DONE) once the peer runs again; the next read from the same peer is exact."""
    monkeypatch.setenv("UCX_TLS", "tcp,self")  # read by UCX when each agent (here and in the peer) starts
    peer = Peer("nixl", NBYTES, "cpu", seed=5)
    agent = create_agent("nixl", f"nixl-silent-{os.getpid()}")
    buf = alloc(NBYTES, "cpu", seed=11)
    reg = agent.register_memory(MemoryRegion.of(buf))
    stopped = False
    try:
        name = _connect_and_read(agent, peer, buf, 5)
        buf[:] = pattern(NBYTES, 11)
        os.kill(peer.proc.pid, signal.SIGSTOP)
        stopped = True
        wait_stopped(peer.proc.pid)
        h = agent.read(name, _whole(buf.ctypes.data), _whole(peer.addr))
        try:
            bound = 1.0
            t0 = time.monotonic()
            with pytest.raises(TransferTimeout, match=f"not done after {bound:g} s"):
                h.wait(bound)
            assert bound <= time.monotonic() - t0 < bound + 2.0
            np.testing.assert_array_equal(buf, pattern(NBYTES, 11))  # no byte came from the silent peer
            assert h.cancel() is True
            assert h.state() is XferState.PENDING  # NIXL cannot stop it: unsettled while the peer is stopped
            os.kill(peer.proc.pid, signal.SIGCONT)
            stopped = False
            deadline = time.monotonic() + 10
            while (st := h.state()) is XferState.PENDING:
                assert time.monotonic() < deadline, "the cancelled read did not settle within 10 s of SIGCONT"
                time.sleep(0.01)
            assert st is XferState.FAILED and h.error == "cancelled"
        finally:
            h.release()
        buf[:] = pattern(NBYTES, 11)  # whatever the cancelled read left, the next one must write every byte
        with agent.read(name, _whole(buf.ctypes.data), _whole(peer.addr)) as h:
            h.wait(30)
        np.testing.assert_array_equal(buf, pattern(NBYTES, 5))
    finally:
        if stopped:
            os.kill(peer.proc.pid, signal.SIGCONT)
        reg.release()
        agent.close()
        peer.close()
