"""Metrics record outcomes, bytes, phases and pinned requests (in-process transceivers, real sockets)."""

from __future__ import annotations

import time

import numpy as np
from prometheus_client import REGISTRY

from kvbridge.formatter.layout import KVLayout, KVShape
from kvbridge.formatter.verify import pool_image
from kvbridge.transceiver import CacheTransceiver, DisaggParams, TransceiverConfig


class _Req:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _value(name, **labels):
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_a_transfer_is_counted_with_its_bytes_and_phases():
    lay = KVLayout(KVShape(2, 2, 8, "float32", 16))
    cfg = TransceiverConfig(agents=("nixl",))
    ctx_buf = pool_image(lay, 0, 8, [([1, 2], 20, 5)]).copy()
    gen_buf = pool_image(lay, 0, 8, [], 9).copy()
    before = (_value("kvbridge_transfers_total", role="generation", outcome="ok"),
              _value("kvbridge_transfer_bytes_total"), _value("kvbridge_phase_seconds_count", phase="read"),
              _value("kvbridge_transfers_total", role="context", outcome="complete"))
    with CacheTransceiver.context(ctx_buf, lay, 0, 8, cfg) as ctx, \
            CacheTransceiver.generation(gen_buf, lay, 0, 8, cfg) as gen:
        secret = ctx.respond_and_send_async(_Req(request_id=1, block_ids=np.array([1, 2]), num_tokens=20))
        # the gauge goes to 1 once the I/O thread takes the request up (bounded wait on that event)
        deadline = time.monotonic() + 10
        while _value("kvbridge_pinned_requests", rank="0") != 1.0:
            assert time.monotonic() < deadline, "the pinned gauge never showed the published request"
            time.sleep(0.01)
        gen.request_and_receive_async(_Req(request_id=1, block_ids=np.array([3, 4]), num_tokens=20,
                                           disagg_params=DisaggParams(1, ctx.instance, (ctx.endpoint,), lay,
                                                                      secret)))
        (r,) = gen.check_gen_transfer_status(1, timeout_s=20)
        assert r.ok
        ctx.check_context_transfer_status(1, timeout_s=5)
    assert _value("kvbridge_transfers_total", role="generation", outcome="ok") == before[0] + 1
    assert _value("kvbridge_transfer_bytes_total") == before[1] + r.nbytes
    assert _value("kvbridge_phase_seconds_count", phase="read") == before[2] + 1
    assert _value("kvbridge_transfers_total", role="context", outcome="complete") == before[3] + 1
    assert _value("kvbridge_pinned_requests", rank="0") == 0.0
    np.testing.assert_array_equal(gen_buf, pool_image(lay, 0, 8, [([3, 4], 20, 5)], 9))
