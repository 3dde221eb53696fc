"""The gloo/nccl agents' rendezvous: no store port, and the pair's store only over a proven connection.

torch's TCPStore (what these agents used) serves and lists its keys to whoever reaches its port, so a stranger
could learn a pair's prefix and set rank 1's address first: the serving agent would send the KV there. Real
agents and sockets; the raw sockets below speak the wire by hand on purpose (a stranger, a peer's misuse).
"""

from __future__ import annotations

import os
import socket
import struct
import time

import numpy as np
import pytest

from kvbridge.agents import MemoryRegion, create_agent
from kvbridge.agents import conn_wire as wire
from kvbridge.agents import dist_connection as dc
from kvbridge.agents import dist_store
from kvbridge.agents.base import DescriptorList
from kvbridge.agents.envelope import open_envelope
from kvbridge.agents.tcp import TcpConnection
from kvbridge.errors import ConnectionFailed

from kvbridge.agents.conformance.peer import pattern

from ..listeners import listening

NBYTES = 1 << 20


@pytest.fixture()
def gloo_server():
    agent = create_agent("gloo", f"gloo-store-{os.getpid()}-{time.monotonic_ns() % 10**9}")
    buf = pattern(NBYTES, 4).copy()
    reg = agent.register_memory(MemoryRegion.of(buf))
    payload = open_envelope(agent.metadata(), "gloo")[1]
    yield agent, buf, payload
    reg.release()
    agent.close()


def _dial(payload, role: int, pair_id: str, key: bytes | None) -> TcpConnection:
    """A raw connection: a HELLO of `role` for `pair_id`, then (with `key`) the answer to the challenge."""
    ep = payload["endpoint"]
    conn = TcpConnection(socket.create_connection((ep["host"], ep["port"]), timeout=5), vectored=False)
    deadline = time.monotonic() + 5
    conn.send(dc._hello("gloo", pair_id, role), deadline)
    if key is None:  # reads the challenge, answers nothing
        conn.recv(np.empty(wire.CHALLENGE_SIZE, dtype=np.uint8), deadline)
    else:
        wire.prove(conn, key, deadline)
    return conn


def test_a_gloo_agent_opens_one_port_and_its_metadata_names_no_store():
    before = listening()
    agent = create_agent("gloo", f"gloo-ports-{os.getpid()}")
    try:
        ep = open_envelope(agent.metadata(), "gloo")[1]["endpoint"]
        assert {port for _, port in listening() - before} == {ep["port"]}
        assert "store_port" not in ep
    finally:
        agent.close()


def test_the_pairs_store_serves_a_proven_store_connection_of_a_live_pair_only(gloo_server):
    agent, buf, payload = gloo_server
    key, pid = payload["key"], os.urandom(16).hex()
    control = _dial(payload, dc.CONTROL, pid, key)  # opens the pair, as a requester's first connection does
    time.sleep(0.2)
    stranger = _dial(payload, dc.STORE, pid, None)  # knows the pair id (say, sniffed), not the key
    stranger.send(np.frombuffer(b"\1" * 64, np.uint8), time.monotonic() + 5)
    with pytest.raises(ConnectionFailed):
        stranger.recv(np.empty(8, np.uint8), time.monotonic() + 5)
    stranger.close()
    unknown = _dial(payload, dc.STORE, os.urandom(16).hex(), key)  # proven, but for no pair
    with pytest.raises(ConnectionFailed):
        unknown.recv(np.empty(8, np.uint8), time.monotonic() + 5)
    unknown.close()

    conn = _dial(payload, dc.STORE, pid, key)
    store = dist_store.remote_store(conn, 2.0)
    store.set("0/1", b"address")
    assert store.get("0/1") == b"address" and store.check(["0/1"]) and not store.check(["0/1", "nope"])
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5 and store.num_keys() == 2
    assert store.compare_set("0/1", b"address", b"other") == b"other"
    assert store.delete_key("n") and not store.delete_key("n")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out"):
        store.wait(["never"])
    assert time.monotonic() - t0 < 10
    second = _dial(payload, dc.STORE, pid, key)  # a pair has one store connection
    with pytest.raises(ConnectionFailed):
        second.recv(np.empty(8, np.uint8), time.monotonic() + 5)
    second.close()
    huge = struct.pack("<BxHII", dist_store.SET, 3, dist_store.MAX_VALUE + 1, 0)
    conn.send(np.frombuffer(huge, np.uint8), time.monotonic() + 5)  # outside the bounds: the connection ends
    with pytest.raises(ConnectionFailed):
        conn.recv(np.empty(8, np.uint8), time.monotonic() + 5)
    conn.close()
    control.close()

    peer = create_agent("gloo", f"gloo-peer-{os.getpid()}")  # and the agent serves a real peer on
    dst = np.zeros(NBYTES, np.uint8)
    reg = peer.register_memory(MemoryRegion.of(dst))
    try:
        name = peer.connect(agent.metadata())
        base, theirs = dst.ctypes.data, buf.ctypes.data
        with peer.read(name, DescriptorList([base], [NBYTES]), DescriptorList([theirs], [NBYTES])) as h:
            h.wait(30)
        np.testing.assert_array_equal(dst, buf)
    finally:
        reg.release()
        peer.close()
