"""The control plane's per-request savings (docs/control-plane.md), each pinned on the wire against a real
context rank (real ZeroMQ, a real NIXL agent):

    Fetch carries Done   a read-ahead Fetch whose reads had all settled is also the reader's Done(ok): the
                         context rank answers it with DoneAck(valid) and the request completes; without
                         read-ahead the claim is refused as malformed (there were no block ids to read)
    batches              one ZeroMQ message may carry up to MAX_BATCH frames, each answered on its own: a bad
                         frame in a batch fails only its own request; a longer message is refused whole
    end to end           a generation rank's read-ahead pulls are byte-exact and each reader's Done reaches
                         the context rank exactly once (in its Fetch when its reads settled as posted)
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import zmq
from kvbridge.formatter.layout import KVLayout, KVShape
from kvbridge.formatter.verify import pool_image
from kvbridge.transceiver import CacheTransceiver, DisaggParams, TransceiverConfig
from kvbridge.transceiver import messages as m

from .ranks import raw_session
from .test_read_ahead import _Relay

LAY = KVLayout(KVShape(2, 2, 8, "float32", 16))
NB = 16
CFG = TransceiverConfig(agents=("nixl",), handshake_timeout_s=1.0, lease_s=10.0, pickup_timeout_s=30.0)


class _Req:
    def __init__(self, rid, blocks, n, params=None):
        self.request_id, self.block_ids, self.num_tokens, self.disagg_params = rid, np.array(blocks), n, params


def _session(endpoint: str) -> zmq.Socket:
    """A raw generation-side DEALER with a session (Hello answered by Welcome)."""
    return raw_session(endpoint, LAY)


def _answers(s: zmq.Socket, count: int) -> list[m.Message]:
    """The next `count` frames, however they were batched into messages."""
    got = []
    while len(got) < count:
        assert s.poll(10000), f"{len(got)} of {count} answers within 10 s"
        got += [m.decode(f) for f in s.recv_multipart()]
    return got


def _fetch_done(rid: int, secret: bytes, blocks, read_ahead: bool = True) -> bytes:
    return m.Fetch(rid, 0, False, False, 0, secret, read_ahead, np.array(blocks), True).encode()


def _finished(ctx, n: int) -> dict[int, str]:
    return {r.ctx_request_id: r.status for r in ctx.check_context_transfer_status(n, timeout_s=10)}


def test_a_read_ahead_fetch_carrying_its_done_gets_done_ack_and_completes_the_request():
    buf = pool_image(LAY, 0, NB, [([1, 2], 20, 5)]).copy()
    with CacheTransceiver.context(buf, LAY, 0, NB, CFG) as ctx:
        secret = ctx.respond_and_send_async(_Req(1, [1, 2], 20))
        s = _session(ctx.endpoint)
        try:
            s.send(_fetch_done(1, secret, [1, 2]))
            (ack,) = _answers(s, 1)
            assert isinstance(ack, m.DoneAck) and ack.ctx_request_id == 1 and ack.valid and ack.intact, ack
            assert _finished(ctx, 1) == {1: "complete"}
            assert ctx.sender.pinned == 0
            s.send(_fetch_done(1, secret, [1, 2]))  # again, after it finished: the tombstone's answer
            (err,) = _answers(s, 1)
            assert isinstance(err, m.Error) and err.code == "unknown_request" and "already finished" in err.message
        finally:
            s.close()


def test_a_batch_holding_bad_frames_fails_only_their_requests():
    blocks = {2: [1, 2], 3: [3, 4], 4: [5, 6]}
    buf = pool_image(LAY, 0, NB, [(b, 20, r) for r, b in blocks.items()]).copy()
    with CacheTransceiver.context(buf, LAY, 0, NB, CFG) as ctx:
        secrets = {r: ctx.respond_and_send_async(_Req(r, b, 20)) for r, b in blocks.items()}
        s = _session(ctx.endpoint)
        try:
            good2 = _fetch_done(2, secrets[2], blocks[2])
            s.send_multipart([good2, good2[: len(good2) // 2],  # truncated: malformed, no request named
                              _fetch_done(3, secrets[3], blocks[3], read_ahead=False),  # Done without read-ahead
                              _fetch_done(4, secrets[4], blocks[4])])
            got = _answers(s, 4)
            assert [type(a).__name__ for a in got] == ["DoneAck", "Error", "Error", "DoneAck"], got
            assert got[0].ctx_request_id == 2 and got[0].valid and got[3].ctx_request_id == 4 and got[3].valid
            assert got[1].code == "malformed" and ("truncated" in got[1].message or "malformed" in got[1].message)
            assert got[2].code == "malformed" and got[2].ctx_request_id == 3
            assert "carries its Done without read-ahead" in got[2].message
            assert _finished(ctx, 2) == {2: "complete", 4: "complete"}
            assert ctx.sender.pinned == 1  # request 3 stays pinned for a reader that reads it properly
            s.send(_fetch_done(3, secrets[3], blocks[3]))
            (ack,) = _answers(s, 1)
            assert isinstance(ack, m.DoneAck) and ack.ctx_request_id == 3 and ack.valid
            assert _finished(ctx, 1) == {3: "complete"} and ctx.sender.pinned == 0
        finally:
            s.close()


def test_a_message_of_more_than_max_batch_frames_is_refused_whole():
    buf = pool_image(LAY, 0, NB, [([1], 10, 5)]).copy()
    with CacheTransceiver.context(buf, LAY, 0, NB, CFG) as ctx:
        secret = ctx.respond_and_send_async(_Req(7, [1], 10))
        s = _session(ctx.endpoint)
        try:
            s.send_multipart([_fetch_done(7, secret, [1])] + [m.Heartbeat([]).encode()] * m.MAX_BATCH)
            (err,) = _answers(s, 1)
            assert isinstance(err, m.Error) and err.code == "malformed"
            assert f"expected 1 to {m.MAX_BATCH} frames per message, got {m.MAX_BATCH + 1}" in err.message
            assert ctx.sender.pinned == 1  # the Fetch inside was not served
            s.send(_fetch_done(7, secret, [1]))
            (ack,) = _answers(s, 1)
            assert isinstance(ack, m.DoneAck) and ack.valid
        finally:
            s.close()


@pytest.mark.parametrize("agent", ["nixl", "tcp"])
def test_read_ahead_pulls_are_byte_exact_and_each_readers_done_arrives_exactly_once(agent):
    # ctx blocks, gen blocks, tokens; the first request also brings the transport's connection up
    reqs = {10: ([8], [8], 16), 11: ([1, 2], [9, 4], 20), 12: ([3], [7], 16), 13: ([5, 6], [0, 15], 30)}
    ctx_buf = pool_image(LAY, 0, NB, [(cb, n, rid) for rid, (cb, _, n) in reqs.items()]).copy()
    gen_buf = pool_image(LAY, 0, NB, [], 9).copy()
    cfg = dataclasses.replace(CFG, agents=(agent,))
    with CacheTransceiver.context(ctx_buf, LAY, 0, NB, cfg) as ctx, \
            CacheTransceiver.generation(gen_buf, LAY, 0, NB, cfg) as gen:
        relay = _Relay(ctx.endpoint)
        try:
            for rid, (cb, gb, n) in reqs.items():
                secret = ctx.respond_and_send_async(_Req(rid, cb, n))
                params = DisaggParams(rid, ctx.instance, (relay.endpoint,), LAY, secret, cb)
                gen.request_and_receive_async(_Req(rid, gb, n, params))
                (r,) = gen.check_gen_transfer_status(1, timeout_s=30)
                assert r.ok and r.request_id == rid, r.error
            assert _finished(ctx, 4) == {rid: "complete" for rid in reqs}
        finally:
            relay.close()
    np.testing.assert_array_equal(gen_buf, pool_image(LAY, 0, NB, [(gb, n, rid) for rid, (_, gb, n) in reqs.items()], 9))
    carried = {rid: [t for r, _, t, done in relay.dones if r == rid and (t == "done" or done)] for rid in reqs}
    assert all(len(c) == 1 for c in carried.values()), carried  # exactly one Done per reader
    if agent == "nixl" and not any(c == ["fetch"] for rid, c in carried.items() if rid != 10):
        pytest.skip("no read settled as it was posted on this machine's transport: nothing to piggyback")


def test_the_context_ranks_agent_progresses_fast_only_while_a_reader_may_be_reading():
    blocks = {21: [1, 2], 22: [3, 4]}
    buf = pool_image(LAY, 0, NB, [(b, 20, r) for r, b in blocks.items()]).copy()
    with CacheTransceiver.context(buf, LAY, 0, NB, CFG) as ctx:
        agent = ctx.pool.agents["nixl"]
        secrets = {r: ctx.respond_and_send_async(_Req(r, b, 20)) for r, b in blocks.items()}
        s = _session(ctx.endpoint)
        try:
            assert not agent.fast_progress  # nobody reads: the idle period (CacheTransceiver's default)
            s.send(m.Fetch(21, 0, False, False, 0, secrets[21], True, np.array(blocks[21])).encode())
            s.send(m.Heartbeat([21]).encode())  # answered after the Fetch: it has been taken
            (ack,) = _answers(s, 1)
            assert isinstance(ack, m.HeartbeatAck) and ack.alive == [True]
            assert agent.fast_progress  # a reader's reads may be in flight
            s.send(m.Done(21, 0, True).encode())
            (ack,) = _answers(s, 1)
            assert isinstance(ack, m.DoneAck) and ack.valid
            assert not agent.fast_progress  # the last reader is done
            s.send(_fetch_done(22, secrets[22], blocks[22]))  # its reads are over: never counted
            (ack,) = _answers(s, 1)
            assert isinstance(ack, m.DoneAck) and ack.valid and not agent.fast_progress
            assert _finished(ctx, 2) == {21: "complete", 22: "complete"}
        finally:
            s.close()
