"""NIXL's own timing of kvbridge's READs (`NixlAgent(telemetry=True)`): what vLLM's NixlConnector reports as
its transfer time, kept on each DONE handle as `transport_span` so a pull can be compared like for like
(bench/vllm.py). A peer process, real UCX; every byte checked."""

from __future__ import annotations

import os

import numpy as np

from kvbridge.agents import MemoryRegion, create_agent
from kvbridge.agents.base import DescriptorList
from kvbridge.agents.handles import ChunkedTransfer
from kvbridge.agents.conformance.peer import Peer, alloc, pattern

NBYTES = 1 << 20


def _read(agent, name: str, buf: np.ndarray, peer: Peer, parts: int = 1):
    step = NBYTES // parts
    hs = [agent.read(name, DescriptorList([buf.ctypes.data + i * step], [step]),
                     DescriptorList([peer.addr + i * step], [step])) for i in range(parts)]
    h = hs[0] if parts == 1 else ChunkedTransfer(hs)
    h.wait(30)
    np.testing.assert_array_equal(buf, pattern(NBYTES, 5))
    return h


def test_a_telemetry_agent_keeps_nixls_time_of_each_read_and_a_plain_one_none():
    peer = Peer("nixl", NBYTES, "cpu", seed=5)
    timed = create_agent("nixl", f"nixl-tel-{os.getpid()}", telemetry=True)
    plain = create_agent("nixl", f"nixl-plain-{os.getpid()}")
    try:
        buf = alloc(NBYTES, "cpu", seed=1)
        regs = [a.register_memory(MemoryRegion.of(buf)) for a in (timed, plain)]
        name_t, name_p = timed.connect(peer.metadata), plain.connect(peer.metadata)
        for _ in range(2):  # the first read also wires the endpoint up
            h = _read(timed, name_t, buf, peer)
            start, end = h.transport_span
            assert 0 <= start <= end
            h.release()
        h = _read(timed, name_t, buf, peer, parts=4)  # a pipelined read: its parts' spans joined
        spans = [p.transport_span for p in h._parts]
        assert h.transport_span == (min(a for a, _ in spans), max(b for _, b in spans))
        h.release()
        h = _read(plain, name_p, buf, peer)
        assert h.transport_span is None
        h.release()
        for r in regs:
            r.release()
    finally:
        timed.close()
        plain.close()
        peer.close()
