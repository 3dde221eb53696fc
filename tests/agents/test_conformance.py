"""The conformance suite every TransferAgent passes: real processes, whole buffers compared.

Parametrised over the agents that run here (CPU host memory). To run it against your own agent, add its
registry name or "module:Class" to HOST_AGENTS (or set KVBRIDGE_CONFORMANCE_AGENTS=spec,spec). The tests
are device-generic: tests/gpu/test_conformance_vram.py runs these same functions on GPU memory through its
own `pair` fixture (`make_pair(spec, "cuda:0", "cuda:1")`).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvbridge.agents import DescriptorList, MemoryRegion, XferState
from kvbridge.errors import AgentError, PeerError, RegistrationError, TransferFailed

from .peer import Peer, alloc, descs, device_of, resolve, restore, to_numpy

HOST_AGENTS = ["nixl", "examples.custom_agent:CmaAgent", "tcp", "gloo", "examples.custom_connection:UdsAgent",
               "tests.agents.chunked:ChunkedCmaAgent"]
if os.environ.get("KVBRIDGE_CONFORMANCE_AGENTS"):
    HOST_AGENTS = os.environ["KVBRIDGE_CONFORMANCE_AGENTS"].split(",")

NBYTES = 8 << 20
TIMEOUT = 30.0


def make_pair(spec: str, local_device: str, peer_device: str):
    """Generator behind `pair`: yields (agent, buffer, peer, peer name), then tears everything down."""
    peer = Peer(spec, NBYTES, peer_device, seed=3)
    agent = resolve(spec)(f"local-{os.getpid()}-{abs(hash(spec)) % 10000}")
    buf = alloc(NBYTES, local_device, seed=11)
    reg = agent.register_memory(MemoryRegion.of(buf))
    name = agent.connect(peer.metadata)
    peer.call("connect", agent.metadata())
    yield agent, buf, peer, name
    reg.release()
    agent.close()
    peer.close()


@pytest.fixture(params=HOST_AGENTS, scope="module")
def pair(request):
    """(local agent, its registered buffer, peer process, peer name as the local agent knows it)."""
    yield from make_pair(request.param, "cpu", "cpu")


def scattered(rng, nbytes: int, count: int, max_len: int, lens=None):
    """`count` disjoint (offset, length) ranges inside nbytes, in random order, varied lengths."""
    slots = nbytes // max_len
    idx = rng.choice(slots, size=count, replace=False)
    if lens is None:
        lens = rng.integers(1, max_len + 1, size=count)
    offs = idx * max_len + rng.integers(0, max_len - lens + 1)
    return offs.astype(np.int64), lens.astype(np.int64)


def test_scattered_read_moves_every_byte_exact(pair):
    agent, buf, peer, name = pair
    rng = np.random.default_rng(0)
    src_off, lens = scattered(rng, NBYTES, 3000, 2048)
    dst_off, _ = scattered(rng, NBYTES, 3000, 2048, lens)  # independent placement on the local side
    before = to_numpy(buf).copy()
    # the peer's bytes as they are now (pattern(NBYTES, 3) plus whatever the write tests put there: they may
    # have run first), not as the fixture made them
    remote = np.frombuffer(peer.call("dump"), dtype=np.uint8).copy()
    h = agent.read(name, descs(buf, dst_off, lens), descs(peer, src_off, lens))
    h.wait(TIMEOUT)
    assert h.state() is XferState.DONE
    h.release()
    expected = before.copy()
    for d, s, n in zip(dst_off, src_off, lens):  # test oracle, not the data path
        expected[d:d + n] = remote[s:s + n]
    np.testing.assert_array_equal(to_numpy(buf), expected)
    restore(buf, before)  # leave the buffer as found for the next test


def test_scattered_write_moves_every_byte_exact(pair):
    agent, buf, peer, name = pair
    rng = np.random.default_rng(1)
    src_off, lens = scattered(rng, NBYTES, 2000, 4096)
    dst_off, _ = scattered(rng, NBYTES, 2000, 4096, lens)
    remote_before = np.frombuffer(peer.call("dump"), dtype=np.uint8).copy()
    h = agent.write(name, descs(buf, src_off, lens), descs(peer, dst_off, lens))
    h.wait(TIMEOUT)
    h.release()
    expected = remote_before.copy()
    local = to_numpy(buf)
    for s, d, n in zip(src_off, dst_off, lens):
        expected[d:d + n] = local[s:s + n]
    np.testing.assert_array_equal(np.frombuffer(peer.call("dump"), dtype=np.uint8), expected)


def test_large_contiguous_read_is_exact(pair):
    agent, buf, peer, name = pair
    before = to_numpy(buf).copy()
    h = agent.read(name, descs(buf, [0], [NBYTES]), descs(peer, [0], [NBYTES]))
    h.wait(TIMEOUT)
    h.release()
    np.testing.assert_array_equal(to_numpy(buf), np.frombuffer(peer.call("dump"), dtype=np.uint8))
    restore(buf, before)


def test_empty_transfer_is_done(pair):
    agent, _buf, _peer, name = pair
    h = agent.read(name, descs(_buf, [], []), descs(_peer, [], []))
    h.wait(1.0)
    assert h.state() is XferState.DONE
    h.release()
    h.release()  # idempotent


def test_local_descriptor_outside_registration_is_refused(pair):
    agent, buf, peer, name = pair
    with pytest.raises(RegistrationError, match="outside every registered"):
        agent.read(name, descs(buf, [NBYTES - 8], [16]), descs(peer, [0], [16]))


def test_remote_descriptor_outside_peer_memory_never_succeeds(pair):
    agent, buf, peer, name = pair
    try:
        h = agent.read(name, descs(buf, [0], [4096]), descs(peer, [NBYTES - 1024], [4096]))
    except AgentError:
        return
    with pytest.raises(TransferFailed):
        h.wait(TIMEOUT)
    h.release()


def test_unknown_peer_and_bad_descriptors_are_refused(pair):
    agent, buf, peer, name = pair
    d = descs(buf, [0], [64])
    with pytest.raises(PeerError, match="not connected"):
        agent.read("nobody", d, d)
    with pytest.raises(AgentError, match="1 local descriptors but 2 remote"):
        agent.read(name, d, descs(peer, [0, 64], [64, 64]))
    with pytest.raises(AgentError, match="64 bytes locally but 32 remotely"):
        agent.read(name, d, descs(peer, [0], [32]))
    with pytest.raises(AgentError, match="equal length"):
        DescriptorList([1, 2], [3])


def test_foreign_or_garbage_metadata_is_refused(pair):
    agent, *_ = pair
    from kvbridge.agents.envelope import seal

    with pytest.raises(PeerError):
        agent.connect(b"\x00garbage")
    with pytest.raises(PeerError, match="agent"):
        agent.connect(seal("someone-else", "x", {}))
    with pytest.raises(PeerError):
        agent.connect(b"")


def test_deregistered_memory_cannot_be_used(pair):
    agent, _buf, peer, name = pair
    extra = alloc(1 << 16, device_of(_buf), seed=5)
    reg = agent.register_memory(MemoryRegion.of(extra))
    h = agent.read(name, descs(extra, [0], [4096]), descs(peer, [0], [4096]))
    h.wait(TIMEOUT)
    h.release()
    remote = np.frombuffer(peer.call("dump"), dtype=np.uint8)
    np.testing.assert_array_equal(to_numpy(extra)[:4096], remote[:4096])
    reg.release()
    with pytest.raises(RegistrationError):
        agent.read(name, descs(extra, [0], [4096]), descs(peer, [0], [4096]))


def test_wait_returns_within_its_deadline(pair):
    """wait(timeout) either finishes or raises TransferTimeout by the deadline; it never hangs."""
    import time

    from kvbridge.errors import TransferTimeout

    agent, buf, peer, name = pair
    before = to_numpy(buf).copy()
    h = agent.read(name, descs(buf, [0], [NBYTES]), descs(peer, [0], [NBYTES]))
    t0 = time.monotonic()
    try:
        h.wait(0.0)
    except TransferTimeout:
        pass
    assert time.monotonic() - t0 < 0.5
    h.wait(TIMEOUT)
    h.release()
    restore(buf, before)
