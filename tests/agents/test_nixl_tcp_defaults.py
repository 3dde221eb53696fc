"""NIXL over UCX's TCP transport with larger segments (docs/agents.md, "NIXL over TCP"): every worker setting
UCX_TCP_TX_SEG_SIZE / UCX_TCP_RX_SEG_SIZE alike moves every byte exactly; a peer that would send segments larger
than this agent receives is refused at connect() with an error naming both settings (UCX itself would abort the
sender on the first transfer). Real processes, real UCX."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvbridge.agents import MemoryRegion, create_agent
from kvbridge.agents.base import DescriptorList
from kvbridge.agents.conformance.peer import Peer, alloc, pattern
from kvbridge.agents.nixl_agent import ucx_tcp_segments
from kvbridge.errors import PeerError

BIG = {"UCX_TCP_TX_SEG_SIZE": "1M", "UCX_TCP_RX_SEG_SIZE": "1M", "UCX_TCP_SNDBUF": "8M", "UCX_TCP_RCVBUF": "8M"}


def _clear(monkeypatch) -> None:
    for k in list(os.environ):
        if k.startswith("UCX_TCP_"):
            monkeypatch.delenv(k)


@pytest.mark.parametrize("tx, rx, want", [(None, None, {"tcp_tx_seg": 8 << 10, "tcp_rx_seg": 64 << 10}),
                                          ("1M", "1m", {"tcp_tx_seg": 1 << 20, "tcp_rx_seg": 1 << 20}),
                                          ("65536", "256kb", {"tcp_tx_seg": 65536, "tcp_rx_seg": 256 << 10}),
                                          ("auto", "2MB", {"tcp_rx_seg": 2 << 20})])
def test_the_segments_are_read_as_ucx_reads_them(monkeypatch, tx, rx, want):
    _clear(monkeypatch)
    for k, v in (("UCX_TCP_TX_SEG_SIZE", tx), ("UCX_TCP_RX_SEG_SIZE", rx)):
        if v is not None:
            monkeypatch.setenv(k, v)
    assert ucx_tcp_segments() == want


def test_a_read_over_ucx_tcp_with_1_mib_segments_on_both_sides_is_exact(monkeypatch):
    """8 MiB from a peer process over UCX's tcp transport, in fragments of 4 MiB, 1 MiB + 3 and odd sizes
    (segments end mid-fragment), out of address order: every byte compared with the peer's pattern."""
    nbytes = 8 << 20
    _clear(monkeypatch)
    monkeypatch.setenv("UCX_TLS", "tcp,self")  # read by UCX when each agent (here and in the peer) starts
    for k, v in BIG.items():
        monkeypatch.setenv(k, v)
    peer = Peer("nixl", nbytes, "cpu", seed=21)
    agent = create_agent("nixl", f"nixl-tcpseg-{os.getpid()}")
    buf = alloc(nbytes, "cpu", seed=3)
    reg = agent.register_memory(MemoryRegion.of(buf))
    try:
        name = agent.connect(peer.metadata)
        lens = np.array([4 << 20, (1 << 20) + 3, 4093, 1 << 16, 0], dtype=np.int64)
        lens[-1] = nbytes - int(lens[:-1].sum())  # the rest: an odd size
        offs = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
        order = np.array([3, 0, 4, 1, 2])
        with agent.read(name, DescriptorList(buf.ctypes.data + offs[order], lens[order]),
                        DescriptorList(peer.addr + offs[order], lens[order])) as h:
            h.wait(60)
        np.testing.assert_array_equal(buf, pattern(nbytes, 21))
    finally:
        reg.release()
        agent.close()
        peer.close()


def test_a_peer_sending_larger_segments_than_this_agent_receives_is_refused_at_connect(monkeypatch):
    """The peer process runs with 1 MiB segments, this agent with UCX's own (64 KiB received): connect() raises
    PeerError naming both settings, and the peer process lives on (nothing was sent)."""
    _clear(monkeypatch)
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    for k, v in BIG.items():
        monkeypatch.setenv(k, v)
    peer = Peer("nixl", 1 << 20, "cpu", seed=5)
    _clear(monkeypatch)
    agent = create_agent("nixl", f"nixl-tcpseg-small-{os.getpid()}")
    try:
        with pytest.raises(PeerError, match=r"peer .* sends UCX TCP segments of 1048576 bytes .*UCX_TCP_RX_SEG_SIZE"):
            agent.connect(peer.metadata)
        assert not agent.peers
        assert peer.proc.is_alive()
    finally:
        agent.close()
        peer.close()
