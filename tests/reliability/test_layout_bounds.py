"""A peer's layout with an absurd world size must be refused at the handshake, not mapped.

KVLayout.from_wire checks types and consistency but bounds neither tp nor pp, and RankMapping builds the
pieces of EVERY generation rank eagerly (O(world size)). A Hello announcing TP=300000 is welcomed, and the
Fetch that follows stalls the context rank's I/O thread for 2.5 s (measured, 2-vCPU VM) before it serves
Blocks to that "reader"; with TP=10**12 the thread never comes back (the mapping grows until memory runs
out). The same layout in a client's disagg_params reaches Receiver.submit -> mapping_for on a generation rank.

Fixed (formatter/layout.py): it refuses tp and pp above a stated limit in ParallelSplit (or at least in
KVLayout.from_wire, which is what remote input goes through), e.g. MAX_TP = MAX_PP = 1024 and world size
<= 4096, with a ProtocolError/LayoutError naming the field; TP=4096 maps in ~0.04 s.
"""

from __future__ import annotations

import numpy as np
import pytest
import zmq

from kvbridge.errors import KvBridgeError
from kvbridge.formatter.layout import KVLayout, KVShape
from kvbridge.formatter.mapping import MAPPING_VERSION
from kvbridge.formatter.verify import pool_image
from kvbridge.transceiver import CacheTransceiver, TransceiverConfig
from kvbridge.transceiver import messages as m

LAY = KVLayout(KVShape(2, 2, 8, "float32", 16))


@pytest.mark.parametrize("field, value", [("tp", 10**12), ("tp", 300_000)])
def test_a_layout_with_an_absurd_world_size_is_refused(field, value):
    wire = {**LAY.to_wire(), field: value}
    with pytest.raises(KvBridgeError, match=field):
        KVLayout.from_wire(wire)


def test_a_context_rank_refuses_a_hello_announcing_tp_300000():
    buf = pool_image(LAY, 0, 8, [([1, 2], 20, 5)]).copy()
    with CacheTransceiver.context(buf, LAY, 0, 8, TransceiverConfig(agents=("nixl",))) as ctx:
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(ctx.endpoint)
        try:
            s.send(
                m.Hello(
                    "huge", 0, {**LAY.to_wire(), "tp": 300_000}, ["nixl"], mapping_version=MAPPING_VERSION
                ).encode()
            )
            assert s.poll(5000)
            ans = m.decode(s.recv())
            assert isinstance(ans, m.Error) and ans.reply_to == "hello" and "tp" in ans.message, ans
        finally:
            s.close()
        assert np.array_equal(buf, pool_image(LAY, 0, 8, [([1, 2], 20, 5)]))
