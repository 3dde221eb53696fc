"""Two small laxities the soak's decoder run found (bench/soak_frames.py, categories "version" and "ext").

1. messages.decode compares the version with `v != PROTOCOL_VERSION`, so `v: true` and `v: 1.0` pass as
   version 1. Fixed: `type(v) is not int or v != PROTOCOL_VERSION`.
2. codec.unpack promises "no ext types", but msgpack decodes ext type -1 (timestamp) itself without calling
   ext_hook, so a msgpack.Timestamp can sit anywhere in a decoded frame (unknown fields are ignored, dict
   fields such as a layout are not checked element by element until later). Fixed: reject non-plain values in
   the depth walk of codec._check_depth (it already visits every container).
Neither crashed anything; both let frames through that the protocol says are invalid (both fixed).
"""

from __future__ import annotations

import msgpack
import pytest

from kvbridge.codec import pack, unpack
from kvbridge.errors import ProtocolError
from kvbridge.transceiver import messages as m


@pytest.mark.parametrize("v", [True, 1.0], ids=["true", "float"])
def test_a_version_that_is_not_the_integer_1_is_refused(v):
    with pytest.raises(ProtocolError, match="protocol version"):
        m.decode(pack({"v": v, "t": "fetch", "ctx_request_id": 1, "gen_rank": 0}))


def test_a_timestamp_ext_is_refused_like_every_other_ext_type():
    with pytest.raises(ProtocolError, match="ext"):
        unpack(msgpack.packb({"t": msgpack.Timestamp(1, 2)}))


def test_other_ext_types_are_refused():
    with pytest.raises(ProtocolError, match="ext type 5"):
        unpack(msgpack.packb({"t": msgpack.ExtType(5, b"abc")}))
