"""Fuzzing the decoder and a live context rank: any bytes give a Message or a ProtocolError, never a crash."""

from __future__ import annotations

import numpy as np
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.codec import pack
from kvbridge.errors import ProtocolError
from kvbridge.formatter.layout import KVLayout, KVShape
from kvbridge.formatter.verify import pool_image
from kvbridge.transceiver import CacheTransceiver, DisaggParams, TransceiverConfig
from kvbridge.transceiver import messages as m

LAY = KVLayout(KVShape(2, 2, 8, "float32", 16))
VALID = [
    m.Hello("g", 0, LAY.to_wire(), ["nixl"]).encode(),
    m.Fetch(7, 0).encode(),
    m.Blocks(7, np.arange(9), 130, 2, 5.0).encode(),
    m.Done(7, 0, True, "", [b"12345678"]).encode(),
    m.Heartbeat([1, 2, 3]).encode(),
    m.Welcome("c", 0, LAY.to_wire(), {"nixl": b"x"}, [1 << 40], 8, "DRAM", 0, 5.0).encode(),
]


def _check(frame: bytes) -> None:
    try:
        msg = m.decode(frame)
    except ProtocolError:
        return
    assert isinstance(msg, m.Message)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_random_bytes_never_crash_the_decoder(data):
    _check(data)


@settings(max_examples=600, deadline=None)
@given(st.sampled_from(VALID), st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=8),
       st.integers(0, 600))
def test_mutated_frames_never_crash_the_decoder(frame, flips, cut):
    b = bytearray(frame)
    for pos, val in flips:
        b[pos % len(b)] = val
    _check(bytes(b[: max(1, len(b) - cut % len(b))]))


json_like = st.recursive(st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats() | st.text(max_size=8)
                         | st.binary(max_size=8),
                         lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids,
                                                                                    max_size=4), max_leaves=20)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(sorted(m.MESSAGE_TYPES)), st.dictionaries(st.text(max_size=16), json_like, max_size=8))
def test_well_formed_maps_with_wrong_fields_never_crash(t, fields):
    _check(pack({"v": m.PROTOCOL_VERSION, "t": t, **fields}))


def test_a_live_context_rank_survives_a_storm_of_bad_frames_and_keeps_serving():
    rng = np.random.default_rng(1)
    cfg = TransceiverConfig(agents=("nixl",))
    ctx_buf = pool_image(LAY, 0, 8, [([1, 2], 20, 5)]).copy()
    with CacheTransceiver.context(ctx_buf, LAY, 0, 8, cfg) as ctx:
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(ctx.endpoint)
        for i in range(3000):
            frame = bytearray(VALID[i % len(VALID)])
            for _ in range(int(rng.integers(0, 4))):
                frame[int(rng.integers(len(frame)))] = int(rng.integers(256))
            s.send_multipart([bytes(frame)] * int(rng.integers(1, 3)))
        answered = 0
        while s.poll(500):
            s.recv()
            answered += 1
        s.close()
        assert answered > 2000  # bad frames get error answers
        secret = ctx.respond_and_send_async(type("R", (), {"request_id": 1, "block_ids": np.array([1, 2]),
                                                           "num_tokens": 20})())
        gen_buf = pool_image(LAY, 0, 8, [], 9).copy()
        with CacheTransceiver.generation(gen_buf, LAY, 0, 8, cfg) as gen:
            gen.request_and_receive_async(type("R", (), {
                "request_id": 1, "block_ids": np.array([3, 4]), "num_tokens": 20,
                "disagg_params": DisaggParams(1, ctx.instance, (ctx.endpoint,), LAY, secret)})())
            (r,) = gen.check_gen_transfer_status(1, timeout_s=20)
        assert r.ok, r.error
        np.testing.assert_array_equal(gen_buf, pool_image(LAY, 0, 8, [([3, 4], 20, 5)], 9))
