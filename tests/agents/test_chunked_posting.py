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
    agent.posts.clear()
    h = agent.read(name, DescriptorList(buf.ctypes.data + perm * frag, np.full(n, frag)),
                   DescriptorList(peer.addr + np.arange(n) * frag, np.full(n, frag)))
    assert h.num_descriptors == n and h.nbytes == n * frag
    # posted as pipelined chunks: a small first one so data moves at once, none over post_chunk, all covered
    assert len(agent.posts) > 1 and agent.posts[0] < agent.post_chunk and max(agent.posts) <= agent.post_chunk
    assert sum(agent.posts) == n
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
    buf[:] = pattern(1 << 20, 12)  # differs from the remote everywhere: what the read writes shows
    before = buf.copy()
    agent.posts.clear()
    with pytest.raises(RegistrationError, match=r"descriptors 800\.\.999"):
        agent.read(name, DescriptorList(addrs, np.full(n, 64)), DescriptorList(peer.addr + np.arange(n) * 64,
                                                                               np.full(n, 64)))
    assert sum(agent.posts) == 800  # the chunks before the bad one were posted, the bad one never was
    # ... and had settled (done, or cancelled) by the time it raised: each of their bytes is either the remote's
    # or untouched, nothing else was written, and nothing lands later
    settled = buf.copy()
    remote = np.frombuffer(peer.call("dump"), dtype=np.uint8)
    head = slice(0, 800 * 64)
    assert np.all((settled[head] == remote[head]) | (settled[head] == before[head]))
    np.testing.assert_array_equal(settled[800 * 64:], before[800 * 64:])
    np.testing.assert_array_equal(buf, settled)


@pytest.mark.parametrize("chunk", [1, 2, 3, 8, 64, 100, 32768])
def test_growing_chunks_cover_the_list_in_order_double_and_stay_within_post_chunk(chunk):
    from kvbridge.agents.handles import chunk_bounds

    for n in list(range(1, 700)) + [65536, 262144, 1 << 20]:
        ends = chunk_bounds(n, chunk, grow=True)
        sizes = np.diff([0] + ends)
        assert ends[-1] == n and (sizes > 0).all() and sizes.max() <= chunk, (n, chunk, ends)
        assert sizes[0] == min(n, max(1, chunk // 8)) or len(sizes) == 1
        body = sizes[:-2]  # every part but the (possibly joined or halved) last two at most doubles its predecessor
        assert (body[1:] <= 2 * body[:-1]).all() and (body[1:] >= body[:-1]).all()
    assert list(np.diff([0] + chunk_bounds(65536, 32768, grow=True))) == [4096, 8192, 16384, 18432, 18432]
    assert chunk_bounds(16384, 32768, grow=True) == [4096, 16384]  # the tail joins the part before
