"""The owner's bounded wait (`check_*_transfer_status(n, timeout_s)`): woken by the I/O thread's result, and
DeadlineExceeded naming the count once timeout_s passes without enough results. A real generation-side
transceiver over NIXL in this process; the result comes from a pull refused at submit (layouts that cannot
pair), so nothing else is needed."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvbridge.errors import DeadlineExceeded
from kvbridge.formatter.layout import KVLayout, KVShape
from kvbridge.formatter.verify import pool_image
from kvbridge.transceiver import CacheTransceiver, DisaggParams, TransceiverConfig

GEN = KVLayout(KVShape(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", tokens_per_block=16))
OTHER = KVLayout(KVShape(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32", tokens_per_block=16))


class _Req:
    def __init__(self, rid: int, params) -> None:
        self.request_id, self.disagg_params, self.block_ids, self.num_tokens = rid, params, np.array([1]), 16


def test_the_owner_is_woken_by_a_result_and_otherwise_times_out_naming_the_count():
    buf = pool_image(GEN, 0, 4, [], 9).copy()
    with CacheTransceiver.generation(buf, GEN, 0, 4, TransceiverConfig(agents=("nixl",))) as gen:
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded, match="0 of 1 generation transfers finished within 0.2 s"):
            gen.check_gen_transfer_status(1, timeout_s=0.2)
        assert 0.2 <= time.monotonic() - t0 < 5
        gen.request_and_receive_async(_Req(7, DisaggParams(1, "ctx", ("tcp://127.0.0.1:9",), OTHER, b"s" * 16)))
        (r,) = gen.check_gen_transfer_status(1, timeout_s=30)  # returns when the result is reported
        assert r.request_id == 7 and not r.ok and r.error_type == "LayoutMismatchError"
        assert gen.check_gen_transfer_status() == []
