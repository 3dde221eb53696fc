"""Pipelined posting (TransferAgent.post_chunk): chunks are checked as they go; a bad descriptor in a late
chunk raises only after the chunks already posted have settled, and the handle covers every part."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.agents import DescriptorList, MemoryRegion, XferState
from kvbridge.errors import RegistrationError

from .chunked import ChunkedCmaAgent
from kvbridge.agents.conformance.peer import Peer, pattern


@pytest.fixture(scope="module")
def pair():
    peer = Peer("tests.agents.chunked:ChunkedCmaAgent", 1 << 20, "cpu", seed=3)
    agent = ChunkedCmaAgent("chunked-local")
    buf = pattern(1 << 20, 11).copy()
    reg = agent.register_memory(MemoryRegion.of(buf))
    yield agent, buf, peer, agent.connect(peer.metadata)
    reg.release()
    agent.close()
    peer.close()


def test_a_chunked_read_is_one_handle_and_byte_exact(pair):
    agent, buf, peer, name = pair
    n, frag = 1000, 512
    perm = np.random.default_rng(0).permutation(n)
    h = agent.read(name, DescriptorList(buf.ctypes.data + perm * frag, np.full(n, frag)),
                   DescriptorList(peer.addr + np.arange(n) * frag, np.full(n, frag)))
    assert h.num_descriptors == n and h.nbytes == n * frag
    h.wait(30)
    assert h.state() is XferState.DONE
    h.release()
    remote = np.frombuffer(peer.call("dump"), dtype=np.uint8)
    np.testing.assert_array_equal(buf.reshape(-1, frag)[perm], remote[: n * frag].reshape(-1, frag))


def test_a_bad_descriptor_in_a_late_chunk_raises_after_earlier_chunks_settle(pair):
    agent, buf, peer, name = pair
    n = 1000
    addrs = buf.ctypes.data + np.arange(n) * 64
    addrs[900] = buf.ctypes.data + (1 << 20)  # outside the registered buffer, in the fourth chunk
    with pytest.raises(RegistrationError, match=r"descriptors 800\.\.999"):
        agent.read(name, DescriptorList(addrs, np.full(n, 64)), DescriptorList(peer.addr + np.arange(n) * 64,
                                                                               np.full(n, 64)))
