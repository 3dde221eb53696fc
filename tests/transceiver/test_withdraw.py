"""A reader that gives up before the publish withdraws its waiting Fetch: its Done(ok=False) comes while the
Fetch waits for the request to be published (an early decode whose client went away), so the context rank
fails the request the moment it is published and its blocks are freed then, not after the pickup timeout or
a lease (60 s and 30 s here: far longer than any wait below). A decode aborted before its pull even began
withdraws the same way (`Receiver.withdraw`: a Fetch, then Done(ok=False), nothing read, nothing reported),
before or after the publish.

Real rank processes, real ZeroMQ; the readers are real generation ranks (TP1 and TP2: every expected reader
must withdraw) and, for the wire rules, a raw DEALER that completed the handshake.
"""

from __future__ import annotations

import time

import pytest

from kvbridge.formatter.layout import KVLayout, KVShape, ParallelSplit
from kvbridge.transceiver import messages as m

from .ranks import Cluster, raw_session

SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", tokens_per_block=16)
CFG = {"agents": ["nixl"], "lease_s": 30.0, "heartbeat_s": 0.25, "pickup_timeout_s": 60.0,
       "handshake_timeout_s": 5.0, "publish_wait_s": 20.0, "transfer_timeout_s": 30.0}


def _finished(c: Cluster, rid: int, within: float) -> list[tuple]:
    """The context ranks' reports of `rid` once every rank has one (at most `within` seconds), else []."""
    deadline = time.monotonic() + within
    while True:
        st = c.ctx_status()
        got = [next((f for f in s["finished"] if f[0] == rid), None) for s in st]
        if all(got):
            return got
        if time.monotonic() > deadline:
            return []
        time.sleep(0.05)


@pytest.mark.parametrize("gen_tp", [1, 2])
def test_a_pull_cancelled_before_the_publish_frees_the_context_blocks_at_the_publish(gen_tp):
    c = Cluster(1 + gen_tp)
    try:
        c.setup(KVLayout(SHAPE), KVLayout(SHAPE, ParallelSplit(gen_tp, 1)), 16, 16, CFG)
        rid = 71
        for p in c.gen:  # the early decode: its Fetch waits on the context rank for the publish
            assert p.call("submit", {"pulls": [(rid, c.params(rid), [2, 3], 20, rid)]}) is True
        time.sleep(0.5)
        for p in c.gen:  # the client went away: the decode cancels its pull
            p.conn.send(("collect", {"cancel": rid, "timeout": 20}))
        for p in c.gen:
            ans = p.conn.recv() if p.conn.poll(40) else {"results": []}
            assert [(r["ok"], r["error_type"]) for r in ans["results"]] == [(False, "RequestCancelled")], ans
            assert ans["failed_written_bytes"] == 0
        time.sleep(0.5)  # the Done crossed
        c.publish([(rid, [5, 6], 20, rid)])
        got = _finished(c, rid, 5.0)
        assert [f[1] for f in got] == ["failed"], got  # at the publish, not after a lease or the pickup timeout
        assert c.wait_ctx_released(2.0)[0]["pinned"] == 0
    finally:
        c.close()


def test_only_a_waiting_fetch_is_withdrawn_and_a_fetch_left_waiting_still_pins_the_request():
    c = Cluster(2)
    try:
        c.setup(KVLayout(SHAPE), KVLayout(SHAPE), 16, 16, CFG)
        s = raw_session(c.endpoints[0], c.gen_layout, "early-reader")
        s.send(m.Done(80, 0, False, "nothing waits for 80").encode())  # no Fetch of ours waits: unknown, as before
        assert s.poll(10000)
        a = m.decode(s.recv())
        assert isinstance(a, m.DoneAck) and not a.valid and "withdrawn" not in a.reason
        s.send(m.Fetch(81, 0, secret=c.key.secret(81)).encode())
        s.send(m.Fetch(82, 0, secret=c.key.secret(82)).encode())
        s.send(m.Done(81, 0, False, "the client went away").encode())
        assert s.poll(10000)
        a = m.decode(s.recv())
        assert isinstance(a, m.DoneAck) and a.ctx_request_id == 81 and a.reason == "withdrawn before the publish"
        c.publish([(81, [4], 10, 81), (82, [5], 10, 82)])
        got = _finished(c, 81, 5.0)
        assert got and got[0][1] == "failed", got
        time.sleep(1.0)
        st = c.ctx_status()[0]
        assert st["pinned"] == 1 and not any(f[0] == 82 for f in st["finished"]), st  # 82's reader still reads
        answers = []
        while s.poll(2000):  # both Fetches were answered at the publish; 81's withdrawal acked only once
            answers.append(m.decode(s.recv()))
        assert sorted((type(a).__name__, a.ctx_request_id) for a in answers) == [("Blocks", 81), ("Blocks", 82)]
        s.send(m.Done(82, 0, False, "gave up after reading").encode())  # a published request: fails as before
        assert _finished(c, 82, 5.0)[0][1] == "failed"
        s.close()
    finally:
        c.close()


@pytest.mark.parametrize("gen_tp", [1, 2])
@pytest.mark.parametrize("when", ["published", "before_publish"])
def test_a_decode_aborted_before_its_pull_withdraws_and_the_context_frees_at_once(gen_tp, when):
    c = Cluster(1 + gen_tp)
    try:
        c.setup(KVLayout(SHAPE), KVLayout(SHAPE, ParallelSplit(gen_tp, 1)), 16, 16, CFG)
        rid = 91
        if when == "published":
            c.publish([(rid, [7, 8], 20, rid)])
        for p in c.gen:
            assert p.call("withdraw", (c.params(rid), 20)) is True
        if when == "before_publish":
            time.sleep(0.5)  # the Fetches and Dones crossed: nothing published yet
            c.publish([(rid, [7, 8], 20, rid)])
        got = _finished(c, rid, 5.0)
        assert [f[1] for f in got] == ["failed"], got
        assert c.wait_ctx_released(2.0)[0]["pinned"] == 0
        for p in c.gen:  # nothing was read into the pool, nothing is reported or left in flight
            assert p.call("gen_status") == {"in_flight": 0}
            ans = p.call("collect", {"timeout": 0.2})
            assert ans["results"] == [] and ans["mismatched_bytes"] == 0, ans
    finally:
        c.close()
