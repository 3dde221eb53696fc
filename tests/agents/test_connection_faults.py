"""Connection agents under faults: dead, silent and unreachable peers, cancel, and hostile request frames.

Real processes and sockets throughout; the only fake is a TCP server that accepts and then says nothing
(fault injection: a hung peer host), and a raw socket that speaks the wire format badly on purpose.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time

import numpy as np
import pytest

from kvbridge.agents import MemoryRegion, XferState, create_agent
from kvbridge.agents import conn_server, dist_connection
from kvbridge.agents import conn_wire as wire
from kvbridge.agents.base import DescriptorList, MemoryKind
from kvbridge.agents.envelope import open_envelope, seal
from kvbridge.errors import PeerError, TransferFailed

from kvbridge.agents.conformance.peer import Peer, alloc, pattern

KINDS = ["tcp", "gloo"]
NBYTES = 1 << 20


def descs(owner, offsets, lengths) -> DescriptorList:
    """Host descriptors of byte ranges (offsets from the start) of a numpy buffer or of a Peer's buffer."""
    base = owner.addr if isinstance(owner, Peer) else int(owner.ctypes.data)
    return DescriptorList(base + np.asarray(offsets, dtype=np.int64), np.asarray(lengths, dtype=np.int64))


def _agent(kind: str, **kw):
    return create_agent(kind, f"{kind}-{os.getpid()}-{time.monotonic_ns() % 10**9}", **kw)


@contextlib.contextmanager
def silent_server():
    """A TCP port that accepts connections and never answers (a hung peer): yields its port."""
    srv = socket.create_server(("127.0.0.1", 0))
    held, stop = [], threading.Event()

    def run():
        srv.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(srv.accept()[0])

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1]
    finally:
        stop.set()
        t.join(5)
        for s in held:
            s.close()
        srv.close()


def _meta(kind: str, port: int) -> bytes:
    ep = {"host": "127.0.0.1", "port": port}
    if kind != "tcp":
        ep.update(backend=kind)
    return seal(kind, "remote-peer", {"endpoint": ep, "key": os.urandom(32)})


@pytest.mark.parametrize("kind", KINDS)
def test_dead_peer_fails_the_transfer_within_seconds_and_agent_recovers(kind):
    peer = Peer(kind, NBYTES, "cpu", seed=3)
    agent = _agent(kind, transfer_timeout=20.0)
    buf = alloc(NBYTES, "cpu", seed=11)
    reg = agent.register_memory(MemoryRegion.of(buf))
    try:
        name = agent.connect(peer.metadata)
        with agent.read(name, descs(buf, [0], [4096]), descs(peer, [0], [4096])) as h:
            h.wait(10)  # the connection (and, for gloo, the group) is up
        peer.proc.kill()
        peer.proc.join(10)
        t0 = time.monotonic()
        h = agent.read(name, descs(buf, [0], [NBYTES]), descs(peer, [0], [NBYTES]))
        with pytest.raises(TransferFailed, match=name):
            h.wait(15)
        assert time.monotonic() - t0 < 5, "a closed socket must fail the transfer at once, not at the timeout"
        h.release()
        peer = Peer(kind, NBYTES, "cpu", seed=4)  # a fresh peer: the agent is still usable
        name = agent.connect(peer.metadata)
        with agent.read(name, descs(buf, [0], [NBYTES]), descs(peer, [0], [NBYTES])) as h:
            h.wait(10)
        np.testing.assert_array_equal(buf, pattern(NBYTES, 4))
    finally:
        reg.release()
        agent.close()
        peer.close()


@pytest.mark.parametrize("kind", KINDS)
def test_silent_peer_fails_at_the_transfer_timeout_not_later(kind):
    agent = _agent(kind, transfer_timeout=0.5)
    buf = alloc(NBYTES, "cpu", seed=1)
    reg = agent.register_memory(MemoryRegion.of(buf))
    with silent_server() as port:
        name = agent.connect(_meta(kind, port))
        t0 = time.monotonic()
        h = agent.read(name, descs(buf, [0], [4096]), DescriptorList([1 << 30], [4096]))
        with pytest.raises(TransferFailed, match="deadline"):
            h.wait(10)
        assert time.monotonic() - t0 < 3
        h.release()
        reg.release()
        t0 = time.monotonic()
        agent.close()
        assert time.monotonic() - t0 < 3


@pytest.mark.parametrize("kind", KINDS)
def test_unreachable_peer_fails_fast(kind):
    s = socket.create_server(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nobody listens there now
    agent = _agent(kind)
    buf = alloc(NBYTES, "cpu", seed=1)
    reg = agent.register_memory(MemoryRegion.of(buf))
    try:
        name = agent.connect(_meta(kind, port))
        t0 = time.monotonic()
        with pytest.raises(TransferFailed, match="cannot connect"):
            agent.write(name, descs(buf, [0], [64]), DescriptorList([1 << 30], [64])).wait(10)
        assert time.monotonic() - t0 < 3
    finally:
        reg.release()
        agent.close()


@pytest.mark.parametrize("kind", KINDS)
def test_cancel_drops_queued_and_aborts_running_transfers(kind):
    agent = _agent(kind, transfer_timeout=60.0)
    buf = alloc(NBYTES, "cpu", seed=1)
    reg = agent.register_memory(MemoryRegion.of(buf))
    remote = DescriptorList([1 << 30], [4096])
    with silent_server() as port:
        name = agent.connect(_meta(kind, port))
        running = agent.read(name, descs(buf, [0], [4096]), remote)
        queued = agent.read(name, descs(buf, [4096], [4096]), remote)
        deadline = time.monotonic() + 5
        while not running._running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert running._running, "the first transfer should be waiting on the silent peer"
        queued.cancel()
        assert queued.state() is XferState.FAILED and queued.error == "cancelled"
        t0 = time.monotonic()
        running.cancel()
        assert running.state() is XferState.FAILED
        with pytest.raises(TransferFailed, match="cancelled"):
            running.wait(1)
        assert time.monotonic() - t0 < 1
        dropped = agent.read(name, descs(buf, [0], [4096]), remote)
        dropped.release()  # releasing a pending handle cancels it
        assert dropped.state() is XferState.FAILED
        pending = agent.read(name, descs(buf, [0], [4096]), remote)
        agent.disconnect(name)
        with pytest.raises(TransferFailed, match="disconnected"):
            pending.wait(2)
        with pytest.raises(PeerError, match="not connected"):
            agent.read(name, descs(buf, [0], [4096]), remote)
        for h in (running, queued, pending):
            h.release()
    reg.release()
    agent.close()


# --- hostile frames against a real serving agent ------------------------------------------------------
@pytest.fixture
def server():
    """A tcp agent serving a registered buffer, and a raw socket factory speaking to its port."""
    agent = _agent("tcp")
    buf = pattern(NBYTES, 9).copy()
    reg = agent.register_memory(MemoryRegion.of(buf))
    payload = open_envelope(agent.metadata(), "tcp")[1]
    ep = payload["endpoint"]

    def dial(key: bytes | None = payload["key"]):
        """A raw connection; with `key` (default: the agent's, from its metadata) it answers the challenge."""
        s = socket.create_connection((ep["host"], ep["port"]), timeout=5)
        s.settimeout(5)
        if key is not None:
            s.sendall(wire.answer(key, np.frombuffer(_recv(s, wire.CHALLENGE_SIZE), np.uint8)).tobytes())
        return s

    yield agent, buf, dial
    reg.release()
    agent.close()


def _recv(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise EOFError(f"closed after {len(out)} of {n} bytes")
        out += chunk
    return out


def _closed_by_server(s: socket.socket) -> bool:
    """True when the server closed the connection (EOF, or a reset because our bytes were left unread)."""
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def _send_unheard(s: socket.socket, *chunks: bytes) -> None:
    """Send what a stranger sends; the server may read the first bytes as a wrong proof and close (a reset
    for the rest) before the last chunk leaves, which is the behaviour under test, not a failure."""
    with contextlib.suppress(ConnectionResetError, BrokenPipeError):
        for chunk in chunks:
            s.sendall(chunk)


def _request(s, op, addrs, lens, rid=1, kind=MemoryKind.DRAM, nbytes=None):
    d = DescriptorList(addrs, lens)
    n = d.nbytes if nbytes is None else nbytes
    s.sendall(wire.Request(op, kind, 0, rid, len(d), n).encode().tobytes())
    s.sendall(wire.encode_descriptors(d).tobytes())
    resp = wire.Response.decode(np.frombuffer(_recv(s, wire.Response.SIZE), np.uint8), rid)
    text = _recv(s, resp.detail).decode() if resp.status == wire.ERROR else ""
    return resp, text


def test_a_caller_without_the_agents_metadata_reads_nothing(server, monkeypatch, caplog):
    """The port alone grants nothing: a new connection must answer the server's challenge with the connection
    key from the agent's metadata (which the transceiver hands only to authenticated peers)."""
    agent, buf, dial = server
    base = buf.ctypes.data
    s = dial(key=None)  # a scanner: straight to a READ of the registered buffer
    assert len(_recv(s, wire.CHALLENGE_SIZE)) == wire.CHALLENGE_SIZE
    _send_unheard(s, wire.Request(wire.READ, MemoryKind.DRAM, 0, 1, 1, 4096).encode().tobytes(),
                  wire.encode_descriptors(DescriptorList([base], [4096])).tobytes())
    assert _closed_by_server(s), "a connection without the proof must be closed, unserved"
    s.close()
    s = dial(key=os.urandom(32))  # a proof under another key
    _send_unheard(s, wire.Request(wire.READ, MemoryKind.DRAM, 0, 1, 1, 4096).encode().tobytes())
    assert _closed_by_server(s)
    s.close()
    assert "did not prove it holds this agent's metadata" in caplog.text
    monkeypatch.setattr(conn_server, "PROOF_TIMEOUT", 0.5)
    s = dial(key=None)  # silent: dropped at the proof's deadline, its thread gone
    s.settimeout(10)
    t0 = time.monotonic()
    assert len(_recv(s, wire.CHALLENGE_SIZE)) == wire.CHALLENGE_SIZE and _closed_by_server(s)
    assert time.monotonic() - t0 < 5
    s.close()
    s = dial()  # the agent still serves a peer that proves it
    resp, _ = _request(s, wire.READ, [base], [64])
    assert resp.status == wire.OK and _recv(s, 64) == buf[:64].tobytes()
    s.close()


def test_a_flood_of_strangers_is_closed_at_once_past_the_cap_and_the_agent_serves_on(server, monkeypatch):
    """At most MAX_UNPROVEN connections wait to answer the challenge; one more is closed at once (no thread),
    and once the silent ones are dropped at the proof's deadline a peer is served again."""
    agent, buf, dial = server
    monkeypatch.setattr(conn_server, "MAX_UNPROVEN", 3)
    monkeypatch.setattr(conn_server, "PROOF_TIMEOUT", 3.0)
    waiting = [dial(key=None) for _ in range(3)]
    for s in waiting:  # each got its challenge: the three slots are taken
        assert len(_recv(s, wire.CHALLENGE_SIZE)) == wire.CHALLENGE_SIZE
    extra = dial(key=None)
    t0 = time.monotonic()
    assert _closed_by_server(extra) and time.monotonic() - t0 < 2.5, "past the cap: closed before any challenge"
    extra.close()
    for s in waiting:
        assert _closed_by_server(s)
        s.close()
    s = dial()
    resp, _ = _request(s, wire.READ, [buf.ctypes.data], [64])
    assert resp.status == wire.OK and _recv(s, 64) == buf[:64].tobytes()
    s.close()


def test_server_refuses_out_of_range_ranges_and_keeps_the_connection(server):
    agent, buf, dial = server
    base = buf.ctypes.data
    s = dial()
    resp, text = _request(s, wire.READ, [base + 64, base + NBYTES - 10], [64, 20])
    assert resp.status == wire.ERROR and "descriptor 1" in text and "outside every registered" in text
    resp, text = _request(s, wire.READ, [base], [64], rid=2, kind=MemoryKind.VRAM)
    assert resp.status == wire.ERROR and "no VRAM memory" in text
    resp, text = _request(s, wire.READ, [base], [64], rid=3, nbytes=65)
    assert resp.status == wire.ERROR and "header says 65" in text
    resp, _ = _request(s, wire.READ, [base + 100, base + 5000], [300, 200], rid=4)  # same connection works
    assert resp.status == wire.OK
    np.testing.assert_array_equal(np.frombuffer(_recv(s, 500), np.uint8),
                                  np.concatenate([buf[100:400], buf[5000:5200]]))
    s.close()


@pytest.mark.parametrize("frame", [
    b"GARBAGE!" * 5,
    wire.Request(wire.READ, MemoryKind.DRAM, 0, 1, wire.MAX_DESCRIPTORS + 1, 64).encode().tobytes(),
])
def test_malformed_frame_closes_only_that_connection(server, frame):
    agent, buf, dial = server
    s = dial()
    s.sendall(frame[:wire.Request.SIZE].ljust(wire.Request.SIZE, b"\0"))
    assert _closed_by_server(s), "the server must drop a connection that sent a malformed header"
    s.close()
    s = dial()
    resp, _ = _request(s, wire.READ, [buf.ctypes.data], [4096])
    assert resp.status == wire.OK
    np.testing.assert_array_equal(np.frombuffer(_recv(s, 4096), np.uint8), buf[:4096])
    s.close()


def test_gloo_listener_drops_a_stranger_and_keeps_serving():
    peer = Peer("gloo", NBYTES, "cpu", seed=3)
    ep = open_envelope(peer.metadata, "gloo")[1]["endpoint"]
    s = socket.create_connection((ep["host"], ep["port"]), timeout=5)
    s.sendall(b"HTTP/1.1 GET / " * 4)
    s.settimeout(8)
    assert _closed_by_server(s)
    s.close()
    agent = _agent("gloo")
    buf = alloc(NBYTES, "cpu", seed=1)
    reg = agent.register_memory(MemoryRegion.of(buf))
    try:
        name = agent.connect(peer.metadata)
        with agent.read(name, descs(buf, [0], [NBYTES]), descs(peer, [0], [NBYTES])) as h:
            h.wait(10)
        np.testing.assert_array_equal(buf, pattern(NBYTES, 3))
    finally:
        reg.release()
        agent.close()
        peer.close()


def test_a_silent_caller_on_the_gloo_port_holds_no_peer_off(monkeypatch):
    """The accept thread reads nothing from a new connection: a caller that connects and says nothing (no
    HELLO, no proof) waits on its own serving thread, and a peer connecting after it is served at once."""
    monkeypatch.setattr(conn_server, "PROOF_TIMEOUT", 60.0)
    monkeypatch.setattr(dist_connection, "HANDSHAKE_TIMEOUT", 60.0)
    server, client = _agent("gloo", transfer_timeout=60.0), _agent("gloo", transfer_timeout=60.0)
    src, dst = pattern(NBYTES, 5).copy(), np.zeros(NBYTES, np.uint8)
    regs = [server.register_memory(MemoryRegion.of(src)), client.register_memory(MemoryRegion.of(dst))]
    ep = open_envelope(server.metadata(), "gloo")[1]["endpoint"]
    silent = socket.create_connection((ep["host"], ep["port"]), timeout=5)
    try:
        time.sleep(0.2)  # the accept thread has taken the silent connection
        name = client.connect(server.metadata())
        with client.read(name, descs(dst, [0], [NBYTES]), descs(src, [0], [NBYTES])) as h:
            h.wait(30)
        np.testing.assert_array_equal(dst, src)
        silent.setblocking(False)
        with pytest.raises(BlockingIOError):  # still waits on its own thread, not dropped to let the peer in
            silent.recv(1 << 16)
    finally:
        silent.close()
        for r in regs:
            r.release()
        client.close()
        server.close()
