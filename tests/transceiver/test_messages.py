"""Wire messages: round trips, and every kind of bad frame raises ProtocolError naming what was wrong."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from kvbridge.codec import pack
from kvbridge.errors import ProtocolError
from kvbridge.transceiver import messages as m

V = m.PROTOCOL_VERSION


def test_every_message_round_trips():
    blocks = np.array([5, 1, 1 << 40, 0], dtype=np.int64)
    b = m.decode(m.Blocks(3, blocks, 60, 4, 10.0).encode())
    assert isinstance(b, m.Blocks) and b.num_tokens == 60 and b.lease_s == 10.0
    np.testing.assert_array_equal(b.block_ids, blocks)
    for msg in (m.Fetch(1, 2, True), m.Done(1, 0, False, "x"), m.DoneAck(1, True), m.Heartbeat([1, 2]),
                m.Error("unknown_request", "no", 4, "fetch"), m.LayersReady(9, 3)):
        assert m.decode(msg.encode()) == msg


@pytest.mark.parametrize("frame, needle", [
    (b"", "empty"),
    (b"\x81", "truncated"),
    (pack([1, 2]), "expected a map"),
    (pack({"v": 99, "t": "fetch"}), "protocol version 99"),
    (pack({"v": V, "t": "steal"}), "unknown message type 'steal'"),
    (pack({"v": V, "t": "fetch", "gen_rank": 0}), "missing field 'ctx_request_id'"),
    (pack({"v": V, "t": "fetch", "ctx_request_id": True, "gen_rank": 0}), "'ctx_request_id' should be int"),
    (pack({"v": V, "t": "blocks", "ctx_request_id": 1, "block_ids": b"123", "num_tokens": 1, "layers_ready": 1,
           "lease_s": 1.0}), "not a multiple of 8"),
    (msgpack.packb({"v": V, "t": "fetch", "x": msgpack.ExtType(1, b"boom")}), "ext type"),
    (pack({"v": V, "t": "fetch", "ctx_request_id": 1 << 63, "gen_rank": 0}), "out of range"),
    (pack({"v": V, "t": "fetch", "ctx_request_id": 1, "gen_rank": 0}) + b"\x00", "trailing"),
])
def test_bad_frames_raise_protocol_error_naming_the_problem(frame, needle):
    with pytest.raises(ProtocolError, match=needle):
        m.decode(frame)


def test_oversized_and_deeply_nested_frames_are_refused():
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        m.decode(b"\x00" * (m.MAX_FRAME_BYTES + 1))
    deep: object = 1
    for _ in range(40):
        deep = [deep]
    with pytest.raises(ProtocolError, match="nested"):
        m.decode(pack({"v": V, "t": "heartbeat", "ctx_request_ids": deep}))
