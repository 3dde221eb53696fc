"""Faults at every phase: leases, aborts, dead peers. Each test checks the error text, the time to detect
(under the deadline), that every pinned block is released exactly once on both sides, and that a following
request succeeds."""

from __future__ import annotations

import time

import pytest
import zmq

from kvbridge.formatter.layout import KVLayout, KVShape
from kvbridge.transceiver import messages as m

from .ranks import Cluster

LAYOUT = KVLayout(KVShape(num_layers=4, num_kv_heads=2, head_dim=16, dtype="float16", tokens_per_block=16))
FAST = {"agents": ["nixl"], "lease_s": 2.0, "heartbeat_s": 0.25, "peer_timeout_s": 2.0, "pickup_timeout_s": 3.0,
        "handshake_timeout_s": 1.0, "transfer_timeout_s": 6.0, "drain_timeout_s": 1.0}
pytestmark = pytest.mark.alone  # FAST: handshakes of 1 s, leases of 2 s (tests/conftest.py)
NB = 64


@pytest.fixture
def cluster():
    c = Cluster(2)
    c.setup(LAYOUT, LAYOUT, NB, NB, FAST)
    yield c
    c.close()


def _pull(rid, c, gen_block=0, n=20):
    return [rid, c.params(rid), [gen_block, gen_block + 1], n, rid]


def _finished(c, rid):
    return [(status, detail) for r, status, detail in c.ctx_status()[0]["finished"] if r == rid]


def _next_request_succeeds(c, rid, ctx_block, gen_block):
    c.publish([(rid, [ctx_block, ctx_block + 1], 20, rid)])
    (ans,) = c.pull([_pull(rid, c, gen_block)])
    assert ans["results"][0]["ok"], ans["results"]
    assert ans["mismatched_bytes"] == 0
    assert c.wait_ctx_released()[0]["pinned"] == 0


def _wait_finished(c, rid, timeout):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        f = _finished(c, rid)
        if f:
            return f, time.monotonic() - t0
        time.sleep(0.02)
    return [], timeout


def _wait_fetched(c, n: int = 1, timeout: float = 5.0) -> None:
    """Wait (bounded) until the context rank has handed blocks to `n` fetches: a generation rank is reading."""
    deadline = time.monotonic() + timeout
    while (got := c.ctx_status()[0]["fetches"]) < n:
        assert time.monotonic() < deadline, f"{got} of {n} fetches reached the context rank within {timeout} s"
        time.sleep(0.01)


def _wait_layers(c, pull: tuple, n: int, timeout: float = 5.0) -> list[int]:
    """Wait (bounded) until at least `n` local layers of `pull` (blocks, tokens, salt) are in the generation
    pool byte for byte; returns the layers that are."""
    deadline = time.monotonic() + timeout
    while len(got := c.gen[0].call("arrived_layers", pull)) < n:
        assert time.monotonic() < deadline, f"layers {got} arrived within {timeout} s, expected {n}"
        time.sleep(0.01)
    return got


def test_unfetched_request_expires_and_a_later_read_is_refused_cleanly(cluster):
    c = cluster
    c.publish([(1, [0, 1], 20, 1)])
    f, took = _wait_finished(c, 1, 5.0)
    assert f == [("expired", "lease expired: no generation rank fetched it")]
    assert took < FAST["pickup_timeout_s"] + 0.5
    assert c.ctx_status()[0]["pinned"] == 0
    (ans,) = c.pull([_pull(1, c)])
    r = ans["results"][0]
    assert not r["ok"] and r["error_type"] == "LeaseExpired" and "lease expired" in r["error"]
    assert ans["mismatched_bytes"] == 0 and ans["failed_written_bytes"] == 0
    _next_request_succeeds(c, 2, 4, 4)


def test_reader_that_stops_renewing_loses_its_lease(cluster):
    c = cluster
    c.publish([(3, [0, 1], 20, 3)])
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(c.endpoints[0])
    s.send(m.Hello("silent-gen", 0, LAYOUT.to_wire(), ["nixl"]).encode())
    assert s.poll(5000) and isinstance(m.decode(s.recv()), m.Welcome)
    s.send(m.Fetch(3, 0, secret=c.key.secret(3)).encode())
    assert s.poll(5000) and isinstance(m.decode(s.recv()), m.Blocks)
    t0 = time.monotonic()
    f, _ = _wait_finished(c, 3, 5.0)
    took = time.monotonic() - t0
    assert f == [("expired", "lease expired: readers stopped renewing the lease")]
    assert took < FAST["lease_s"] + 0.5
    s.send(m.Done(3, 0, True).encode())  # too late: the context side says the blocks were not pinned
    assert s.poll(5000)
    ack = m.decode(s.recv())
    assert isinstance(ack, m.DoneAck) and not ack.valid and "expired" in ack.reason
    s.close()
    _next_request_succeeds(c, 4, 4, 4)


def test_abort_before_handover_releases_once_and_refuses_the_read(cluster):
    c = cluster
    c.publish([(5, [0, 1], 20, 5)])
    c.ctx[0].call("cancel", 5)
    f, _ = _wait_finished(c, 5, 2.0)
    assert f == [("cancelled", "cancelled by the context executor")]
    (ans,) = c.pull([_pull(5, c)])
    r = ans["results"][0]
    assert not r["ok"] and r["error_type"] == "RequestCancelled" and "cancelled" in r["error"]
    assert ans["mismatched_bytes"] == 0 and ans["failed_written_bytes"] == 0
    assert _finished(c, 5) == f  # exactly once
    _next_request_succeeds(c, 6, 4, 4)


def test_generation_abort_during_read_frees_both_sides_once(cluster):
    c = cluster
    c.ctx[0].call("publish_streaming", [(7, [0, 1], 20, 7)])  # no layer ready: the read is in progress
    c.gen[0].call("submit", {"pulls": [_pull(7, c)]})
    _wait_fetched(c)
    assert c.ctx_status()[0]["pinned"] == 1
    t0 = time.monotonic()
    ans = c.gen[0].call("collect", {"cancel": 7, "timeout": 5})
    r = ans["results"][0]
    assert not r["ok"] and r["error_type"] == "RequestCancelled"
    f, _ = _wait_finished(c, 7, 3.0)
    assert f == [("failed", "a generation rank reported a failed read")]
    assert time.monotonic() - t0 < 2.0
    assert c.ctx_status()[0]["pinned"] == 0 and _finished(c, 7) == f
    _next_request_succeeds(c, 8, 4, 4)


def test_context_abort_during_read_stops_the_reader_then_releases(cluster):
    c = cluster
    c.ctx[0].call("publish_streaming", [(9, [0, 1], 20, 9)])
    c.gen[0].call("submit", {"pulls": [_pull(9, c)]})
    _wait_fetched(c)
    t0 = time.monotonic()
    c.ctx[0].call("cancel", 9)
    ans = c.gen[0].call("collect", {"timeout": 5})
    r = ans["results"][0]
    assert not r["ok"] and r["error_type"] == "RequestCancelled" and "cancelled on the context side" in r["error"]
    f, _ = _wait_finished(c, 9, 3.0)
    assert f and f[0][0] == "cancelled"
    assert time.monotonic() - t0 < 2.0
    assert c.ctx_status()[0]["pinned"] == 0
    _next_request_succeeds(c, 10, 4, 4)


def test_abort_after_handover_changes_nothing(cluster):
    c = cluster
    _next_request_succeeds(c, 11, 0, 0)
    c.ctx[0].call("cancel", 11)
    _next_request_succeeds(c, 111, 4, 4)  # the I/O thread takes commands in order: the cancel was handled
    assert _finished(c, 11) == [("complete", "all readers confirmed")]
    assert c.ctx_status()[0]["pinned"] == 0


def test_streamed_layers_arrive_as_they_become_ready(cluster):
    c = cluster
    c.ctx[0].call("publish_streaming", [(12, [0, 1], 20, 12)])
    c.gen[0].call("submit", {"pulls": [_pull(12, c)]})
    _wait_fetched(c)
    pull = ([0, 1], 20, 12)  # the generation blocks, tokens and salt of the pull
    assert c.gen[0].call("arrived_layers", pull) == []  # no layer ready: none read
    for layers in (1, 3, 4):
        c.ctx[0].call("layers_ready", (12, layers))
        # each ready layer arrives while the later ones are still not ready (so not read): in order, no sooner
        assert _wait_layers(c, pull, layers) == list(range(layers))
    ans = c.gen[0].call("collect", {"timeout": 5})
    assert ans["results"][0]["ok"] and ans["mismatched_bytes"] == 0
    assert c.wait_ctx_released()[0]["pinned"] == 0


def test_killed_context_rank_is_detected_within_the_deadline(cluster):
    c = cluster
    c.ctx[0].call("publish_streaming", [(13, [0, 1], 20, 13)])
    c.gen[0].call("submit", {"pulls": [_pull(13, c)]})
    _wait_fetched(c)
    t0 = time.monotonic()
    c.ctx[0].proc.kill()  # kill -9 mid-transfer
    ans = c.gen[0].call("collect", {"timeout": 5})
    took = time.monotonic() - t0
    r = ans["results"][0]
    # its kernel closed the connection: seen within handshake_timeout_s (not the longer silence bound)
    assert not r["ok"] and r["error_type"] == "PeerGone" and "connection dropped" in r["error"], r
    assert took < FAST["handshake_timeout_s"] + FAST["drain_timeout_s"] + 0.8
    # a restarted context rank serves the next request to the same generation rank
    from .ranks import RankProc

    c.procs[0] = RankProc()
    c.ctx[0] = c.procs[0]
    c.endpoints[0] = c.ctx[0].call("init", {"role": "context", "layout": LAYOUT.to_wire(), "rank": 0,
                                            "num_blocks": NB, "config": FAST, "instance": c.instance + "-2",
                                            "request_key": c.key.hex})
    c.instance += "-2"
    _next_request_succeeds(c, 14, 4, 4)


def test_a_pull_to_a_context_rank_that_died_while_idle_fails_by_name_long_before_its_deadline():
    """The session was up and idle when the context process died; a pull sent later on it must not wait for
    its 60 s deadline or the 300 s silence bound: the lost connection names the peer within seconds."""
    c = Cluster(2)
    try:
        c.setup(LAYOUT, LAYOUT, NB, NB, {**FAST, "peer_timeout_s": 300.0, "lease_s": 30.0, "heartbeat_s": 1.0,
                                         "transfer_timeout_s": 60.0, "handshake_timeout_s": 2.0})
        _next_request_succeeds(c, 21, 0, 0)  # the session is READY
        c.publish([(22, [2, 3], 20, 22)])
        params = c.params(22)
        c.ctx[0].proc.kill()
        c.ctx[0].proc.join(10)
        t0 = time.monotonic()
        (ans,) = c.pull([[22, params, [2, 3], 20, 22]], timeout=30)
        took = time.monotonic() - t0
        r = ans["results"][0]
        assert not r["ok"] and r["error_type"] == "PeerGone" and "connection dropped" in r["error"], r
        assert c.endpoints[0] in r["error"] and took < 2.0 + 1.5, took
    finally:
        c.close()


def test_a_frozen_context_rank_whose_connection_stays_up_fails_as_silent(cluster):
    """SIGSTOP: the connection stays up but nothing answers; the silence bound (peer_timeout_s) names it."""
    import os
    import signal

    c = cluster
    c.ctx[0].call("publish_streaming", [(23, [0, 1], 20, 23)])
    c.gen[0].call("submit", {"pulls": [_pull(23, c)]})
    _wait_fetched(c)
    os.kill(c.ctx[0].proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        ans = c.gen[0].call("collect", {"timeout": 6})
        took = time.monotonic() - t0
    finally:
        os.kill(c.ctx[0].proc.pid, signal.SIGCONT)
    r = ans["results"][0]
    assert not r["ok"] and r["error_type"] == "PeerGone" and "silent for" in r["error"], r
    assert took < FAST["peer_timeout_s"] + FAST["drain_timeout_s"] + 0.8


def test_killed_generation_rank_releases_the_context_blocks(cluster):
    c = cluster
    c.ctx[0].call("publish_streaming", [(15, [0, 1], 20, 15)])
    c.gen[0].call("submit", {"pulls": [_pull(15, c)]})
    _wait_fetched(c)
    assert c.ctx_status()[0]["pinned"] == 1
    t0 = time.monotonic()
    c.gen[0].proc.kill()
    f, _ = _wait_finished(c, 15, 5.0)
    took = time.monotonic() - t0
    assert f == [("expired", "lease expired: readers stopped renewing the lease")]
    assert took < FAST["lease_s"] + 0.5
    assert c.ctx_status()[0]["pinned"] == 0
    from .ranks import RankProc

    c.procs[1] = c.gen[0] = RankProc()
    c.gen[0].call("init", {"role": "generation", "layout": LAYOUT.to_wire(), "rank": 0, "num_blocks": NB,
                           "config": FAST, "instance": "gen-restarted"})
    _next_request_succeeds(c, 16, 4, 4)


def test_verification_turns_silent_corruption_into_a_failed_transfer():
    c = Cluster(2)
    try:
        c.setup(LAYOUT, LAYOUT, NB, NB, {**FAST, "verify": True})
        _next_request_succeeds(c, 20, 0, 0)  # verified and intact
        c.gen[0].call("corrupt_next")
        c.publish([(21, [4, 5], 20, 21)])
        (ans,) = c.pull([_pull(21, c, 4)])
        r = ans["results"][0]
        assert not r["ok"] and r["error_type"] == "IntegrityError"
        assert "differs from the context copy in layers [0]" in r["error"]
        assert ans["mismatched_bytes"] == 0  # everything outside the failed request's blocks is as it was
        f, _ = _wait_finished(c, 21, 3.0)
        assert f == [("failed", "a generation rank reported a failed read")]
        assert c.ctx_status()[0]["pinned"] == 0
        _next_request_succeeds(c, 22, 8, 8)
    finally:
        c.close()
