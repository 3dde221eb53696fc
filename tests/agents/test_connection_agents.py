"""Connection agents (tcp, gloo) beyond the conformance suite: concurrency both ways, the no-readv fallback,
the registry, and metadata from the wrong kind of peer. Real processes and sockets, whole buffers compared.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from kvbridge.agents import DescriptorList, MemoryRegion, available_agents, create_agent
from kvbridge.agents.envelope import seal
from kvbridge.errors import AgentError, PeerError, TransferFailed

from kvbridge.agents.conformance.peer import Peer, alloc, pattern

KINDS = ["tcp", "gloo"]
NBYTES = 4 << 20


def descs(owner, offsets, lengths) -> DescriptorList:
    """Host descriptors of byte ranges (offsets from the start) of a numpy buffer or of a Peer's buffer."""
    base = owner.addr if isinstance(owner, Peer) else int(owner.ctypes.data)
    return DescriptorList(base + np.asarray(offsets, dtype=np.int64), np.asarray(lengths, dtype=np.int64))


def _agent(kind: str, **kw):
    return create_agent(kind, f"{kind}-{os.getpid()}-{time.monotonic_ns() % 10**9}", **kw)


@pytest.mark.parametrize("kind", KINDS)
def test_reads_posted_from_many_threads_are_all_exact(kind):
    peer = Peer(kind, NBYTES, "cpu", seed=3)
    agent = _agent(kind)
    buf = np.zeros(NBYTES, np.uint8)
    reg = agent.register_memory(MemoryRegion.of(buf))
    remote = pattern(NBYTES, 3)
    try:
        name = agent.connect(peer.metadata)
        quarter = NBYTES // 4
        errors: list[BaseException] = []

        def worker(t: int) -> None:  # thread t fills quarter t with scattered 1 KiB pieces, mirrored order
            try:
                offs = t * quarter + np.arange(0, quarter, 1024, dtype=np.int64)
                lens = np.full(offs.shape, 1024, np.int64)
                for part in np.array_split(np.arange(offs.shape[0]), 4):
                    h = agent.read(name, descs(buf, offs[part], lens[part]),
                                   descs(peer, offs[part][::-1].copy(), lens[part]))
                    h.wait(20)
                    h.release()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        expected = np.empty_like(buf)
        for t in range(4):
            offs = t * quarter + np.arange(0, quarter, 1024)
            for part in np.array_split(np.arange(offs.shape[0]), 4):
                src = offs[part][::-1]
                for d, s in zip(offs[part], src):  # test oracle, not the data path
                    expected[d:d + 1024] = remote[s:s + 1024]
        np.testing.assert_array_equal(buf, expected)
    finally:
        reg.release()
        agent.close()
        peer.close()


@pytest.mark.parametrize("kind", KINDS)
def test_two_agents_read_and_write_each_other_at_the_same_time(kind):
    a, b = _agent(kind), _agent(kind)
    abuf, bbuf = pattern(NBYTES, 1).copy(), pattern(NBYTES, 2).copy()
    regs = [a.register_memory(MemoryRegion.of(abuf)), b.register_memory(MemoryRegion.of(bbuf))]
    try:
        bname, aname = a.connect(b.metadata()), b.connect(a.metadata())
        half = NBYTES // 2
        # a pulls b's first half into its second half while b pushes its second half into a's first half
        h1 = a.read(bname, descs(abuf, [half], [half]), descs(bbuf, [0], [half]))
        h2 = b.write(aname, descs(bbuf, [half], [half]), descs(abuf, [0], [half]))
        h1.wait(20)
        h2.wait(20)
        h1.release()
        h2.release()
        theirs = pattern(NBYTES, 2)
        np.testing.assert_array_equal(abuf, np.concatenate([theirs[half:], theirs[:half]]))
        np.testing.assert_array_equal(bbuf, pattern(NBYTES, 2))
    finally:
        for r in regs:
            r.release()
        a.close()
        b.close()


def test_tcp_without_readv_writev_moves_every_byte():
    a, b = _agent("tcp", vectored=False), _agent("tcp", vectored=False)
    abuf, bbuf = pattern(NBYTES, 5).copy(), pattern(NBYTES, 6).copy()
    regs = [a.register_memory(MemoryRegion.of(abuf)), b.register_memory(MemoryRegion.of(bbuf))]
    try:
        bname = a.connect(b.metadata())
        b.connect(a.metadata())
        rng = np.random.default_rng(2)
        slots = rng.choice(NBYTES // 4096, 400, replace=False).astype(np.int64) * 4096
        lens = rng.integers(1, 4097, 400).astype(np.int64)
        with a.write(bname, descs(abuf, slots, lens), descs(bbuf, slots[::-1].copy(), lens)) as h:
            h.wait(20)
        expected = pattern(NBYTES, 6).copy()
        for s, d, n in zip(slots, slots[::-1], lens):
            expected[d:d + n] = abuf[s:s + n]
        np.testing.assert_array_equal(bbuf, expected)
        with a.read(bname, descs(abuf, [0], [NBYTES]), descs(bbuf, [0], [NBYTES])) as h:
            h.wait(20)
        np.testing.assert_array_equal(abuf, expected)
    finally:
        for r in regs:
            r.release()
        a.close()
        b.close()


def test_deregistration_waits_for_a_request_being_served():
    a, b = _agent("tcp"), _agent("tcp")
    abuf, bbuf = np.zeros(32 << 20, np.uint8), pattern(32 << 20, 8).copy()
    ra, rb = a.register_memory(MemoryRegion.of(abuf)), b.register_memory(MemoryRegion.of(bbuf))
    try:
        bname = a.connect(b.metadata())
        h = a.read(bname, descs(abuf, [0], [abuf.nbytes]), descs(bbuf, [0], [bbuf.nbytes]))
        time.sleep(0.005)
        rb.release()  # returns only once no serving thread is inside bbuf
        try:
            h.wait(20)  # it was either served whole before the release, or refused; never torn
            np.testing.assert_array_equal(abuf, bbuf)
        except TransferFailed as e:  # refused: failed cleanly, touched nothing
            assert "no DRAM memory registered" in str(e) or "outside every registered" in str(e), e
            assert not abuf.any()
        h.release()
    finally:
        ra.release()
        a.close()
        b.close()


def test_registry_knows_the_connection_agents_and_checks_options():
    assert {"tcp", "gloo", "nccl"} <= set(available_agents())
    with pytest.raises(AgentError, match="unknown tcp agent options"):
        create_agent("tcp", "x", hostname="oops")
    with pytest.raises(AgentError, match="unknown gloo agent options"):
        create_agent("gloo", "x", backend="nccl")
    with pytest.raises(AgentError, match="positive"):
        create_agent("tcp", "x", transfer_timeout=0)


def test_nccl_agent_explains_what_it_needs_on_a_cpu_machine():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the multigpu suite covers the nccl agent")
    with pytest.raises(AgentError, match="needs torch with CUDA and NCCL"):
        create_agent("nccl", "x")


def test_metadata_from_the_wrong_kind_or_with_a_bad_endpoint_is_refused():
    tcp, gloo = _agent("tcp"), _agent("gloo")
    try:
        with pytest.raises(PeerError, match="from a 'tcp' agent"):
            gloo.connect(tcp.metadata())
        with pytest.raises(PeerError, match="not a TCP port"):
            tcp.connect(seal("tcp", "p", {"endpoint": {"host": "127.0.0.1", "port": 0}}))
        with pytest.raises(PeerError, match="host"):
            tcp.connect(seal("tcp", "p", {"endpoint": {"host": 5, "port": 80}}))
        with pytest.raises(PeerError, match="key"):  # the connection key the server will ask to be proven
            tcp.connect(seal("tcp", "p", {"endpoint": {"host": "127.0.0.1", "port": 80}}))
        with pytest.raises(PeerError, match="key of 3 bytes"):
            tcp.connect(seal("tcp", "p", {"endpoint": {"host": "127.0.0.1", "port": 80}, "key": b"abc"}))
        with pytest.raises(PeerError, match="backend 'nccl'"):
            gloo.connect(seal("gloo", "p", {"endpoint": {"host": "h", "port": 5,
                                                         "backend": "nccl"}}))
        with pytest.raises(PeerError, match="missing field 'endpoint'"):
            tcp.connect(seal("tcp", "p", {}))
        with pytest.raises(PeerError, match="own name"):
            tcp.connect(tcp.metadata())
        with pytest.raises(AgentError, match="cannot register VRAM"):
            from kvbridge.agents import MemoryKind

            tcp.register_memory(MemoryRegion(1 << 20, 4096, MemoryKind.VRAM, 0))
    finally:
        tcp.close()
        gloo.close()


def test_restarted_peer_is_reached_at_its_new_endpoint():
    a = _agent("tcp")
    buf = alloc(NBYTES, "cpu", seed=1)
    reg = a.register_memory(MemoryRegion.of(buf))
    first = Peer("tcp", NBYTES, "cpu", seed=21)
    try:
        name = a.connect(first.metadata)
        with a.read(name, descs(buf, [0], [NBYTES]), descs(first, [0], [NBYTES])) as h:
            h.wait(10)
        np.testing.assert_array_equal(buf, pattern(NBYTES, 21))
        first.close()
        second = Peer("tcp", NBYTES, "cpu", seed=22)
        try:
            # same agent object, new metadata under a new name: the old link is independent of the new one
            name2 = a.connect(second.metadata)
            with a.read(name2, descs(buf, [0], [NBYTES]), descs(second, [0], [NBYTES])) as h:
                h.wait(10)
            np.testing.assert_array_equal(buf, pattern(NBYTES, 22))
        finally:
            second.close()
    finally:
        reg.release()
        a.close()


@pytest.mark.parametrize("spec", ["gloo", "examples.custom_connection:UdsAgent"])
def test_transfers_of_many_staging_chunks_arrive_in_order(monkeypatch, spec):
    """Staged connections split a transfer into chunks (gloo: double-buffered, two tags); with 64 KiB of
    staging, 4 MiB of odd-sized scattered ranges makes ~100 chunks that must land in order."""
    from kvbridge.agents.conformance.peer import resolve

    cls = resolve(spec)
    monkeypatch.setattr(cls.connection_class, "staging_bytes", 64 << 10)
    a, b = cls(f"a-{os.getpid()}"), cls(f"b-{os.getpid()}")
    abuf, bbuf = pattern(NBYTES, 31).copy(), pattern(NBYTES, 32).copy()
    regs = [a.register_memory(MemoryRegion.of(abuf)), b.register_memory(MemoryRegion.of(bbuf))]
    try:
        bname = a.connect(b.metadata())
        rng = np.random.default_rng(7)
        src = rng.choice(NBYTES // 8192, 500, replace=False).astype(np.int64) * 8192
        dst = rng.choice(NBYTES // 8192, 500, replace=False).astype(np.int64) * 8192
        lens = rng.integers(1, 8193, 500).astype(np.int64)
        with a.read(bname, descs(abuf, dst, lens), descs(bbuf, src, lens)) as h:
            h.wait(30)
        expected = pattern(NBYTES, 31).copy()
        for d, s, n in zip(dst, src, lens):
            expected[d:d + n] = bbuf[s:s + n]
        np.testing.assert_array_equal(abuf, expected)
        with a.write(bname, descs(abuf, [0], [NBYTES]), descs(bbuf, [0], [NBYTES])) as h:
            h.wait(30)
        np.testing.assert_array_equal(bbuf, expected)
    finally:
        for r in regs:
            r.release()
        a.close()
        b.close()
