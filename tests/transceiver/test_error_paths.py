"""Receiver error paths between two real rank processes (ZeroMQ + NIXL): each test checks the error text, the
time to detect, that the generation pool is untouched outside the failed pull's blocks and that the context
rank ends with nothing pinned, then that a following request succeeds.

    per-pull deadline        a pull whose layers never become ready fails at ITS deadline (DeadlineExceeded)
    restarted context side   params naming an older context instance fail at the handshake (RequestNotFound)
    unknown request          params naming a request the context rank never published (RequestNotFound)
"""

from __future__ import annotations

import time

import pytest

from kvbridge.formatter.layout import KVLayout, KVShape

from .ranks import Cluster

LAYOUT = KVLayout(KVShape(num_layers=4, num_kv_heads=2, head_dim=16, dtype="float16", tokens_per_block=16))
FAST = {"agents": ["nixl"], "lease_s": 2.0, "heartbeat_s": 0.25, "peer_timeout_s": 3.0, "pickup_timeout_s": 3.0,
        "handshake_timeout_s": 1.0, "transfer_timeout_s": 20.0, "drain_timeout_s": 1.0}
pytestmark = pytest.mark.alone  # FAST: handshakes of 1 s, leases of 2 s (tests/conftest.py)
NB = 32


@pytest.fixture
def cluster():
    c = Cluster(2)
    c.setup(LAYOUT, LAYOUT, NB, NB, FAST)
    yield c
    c.close()


def _finished(c, rid):
    return [(status, detail) for r, status, detail in c.ctx_status()[0]["finished"] if r == rid]


def _wait_finished(c, rid, timeout):
    deadline = time.monotonic() + timeout
    while not (f := _finished(c, rid)):
        assert time.monotonic() < deadline, f"context request {rid} not finished within {timeout} s"
        time.sleep(0.02)
    return f


def _next_request_succeeds(c, rid, ctx_block, gen_block):
    c.publish([(rid, [ctx_block, ctx_block + 1], 20, rid)])
    (ans,) = c.pull([[rid, c.params(rid), [gen_block, gen_block + 1], 20, rid]])
    assert ans["results"][0]["ok"], ans["results"]
    assert ans["mismatched_bytes"] == 0
    assert c.wait_ctx_released()[0]["pinned"] == 0


def test_a_pull_past_its_own_deadline_fails_then_and_releases_the_context(cluster):
    c = cluster
    c.ctx[0].call("publish_streaming", [(1, [0, 1], 20, 1)])  # no layer ever becomes ready
    t0 = time.monotonic()
    (ans,) = c.pull([[1, c.params(1), [0, 1], 20, 1, 1.5]])  # a 1.5 s deadline for this pull alone
    took = time.monotonic() - t0
    r = ans["results"][0]
    assert not r["ok"] and r["error_type"] == "DeadlineExceeded", r
    assert "request 1 (context request 1) not received within its deadline (stage: " in r["error"]
    assert 1.5 <= took < 1.5 + FAST["drain_timeout_s"] + 2.0, f"failed after {took:.2f} s"
    assert ans["mismatched_bytes"] == 0  # nothing outside the failed pull's blocks was written
    assert _wait_finished(c, 1, 5.0) == [("failed", "a generation rank reported a failed read")]
    assert c.ctx_status()[0]["pinned"] == 0
    _next_request_succeeds(c, 2, 4, 0)  # the failed pull's blocks, reused


def test_params_from_a_restarted_context_instance_fail_at_the_handshake(cluster):
    c = cluster
    c.publish([(3, [0, 1], 20, 3)])
    stale = {**c.params(3), "ctx_instance": "ctx-before-restart"}
    t0 = time.monotonic()
    (ans,) = c.pull([[3, stale, [0, 1], 20, 3]])
    took = time.monotonic() - t0
    r = ans["results"][0]
    assert not r["ok"] and r["error_type"] == "RequestNotFound", r
    assert (f"restarted (instance {c.instance}, request issued by ctx-before-restart)") in r["error"]
    assert took < FAST["handshake_timeout_s"] + 2.0, f"failed after {took:.2f} s"
    assert ans["mismatched_bytes"] == 0 and ans["failed_written_bytes"] == 0
    # nobody fetched request 3: the context side frees it at its pickup timeout
    assert _wait_finished(c, 3, FAST["pickup_timeout_s"] + 2.0) == [
        ("expired", "lease expired: no generation rank fetched it")]
    assert c.ctx_status()[0]["pinned"] == 0
    _next_request_succeeds(c, 4, 4, 4)


def test_params_naming_an_unpublished_request_fail_without_touching_the_pool(cluster):
    c = cluster
    t0 = time.monotonic()
    (ans,) = c.pull([[5, c.params(424242), [0, 1], 20, 5]])
    took = time.monotonic() - t0
    r = ans["results"][0]
    assert not r["ok"] and r["error_type"] == "RequestNotFound" and "424242" in r["error"], r
    assert took < FAST["handshake_timeout_s"] + 2.0, f"failed after {took:.2f} s"
    assert ans["mismatched_bytes"] == 0 and ans["failed_written_bytes"] == 0
    assert c.ctx_status()[0]["pinned"] == 0
    _next_request_succeeds(c, 6, 0, 0)
