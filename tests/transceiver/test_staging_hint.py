"""A large pull read directly over NIXL in many small fragments says once, by name, how to stage it: NIXL's cost
per descriptor bounds such a read (3.2-3.8 GB/s for 16 KiB fragments between two H100s, bench/RESULTS.md
"Session 6"). The rule alone, then a real in-process NIXL pull of 64 MiB in 16 KiB fragments."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from kvbridge.formatter.layout import KVLayout, KVShape
from kvbridge.formatter.verify import pool_image
from kvbridge.transceiver import CacheTransceiver, DisaggParams, TransceiverConfig
from kvbridge.transceiver.pull import ReceiveResult
from kvbridge.transceiver.receiver_work import HINT_MIN_BYTES, StagingPolicy

LOGGER = "kvbridge.transceiver.receiver"


def _hints(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "staging arena" in r.getMessage()]


def test_the_hint_names_the_request_the_fragments_and_the_setting_once(caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    policy = StagingPolicy(None, TransceiverConfig())
    small = ReceiveResult(7, True, nbytes=1 << 30, fragments=65536, agents=("nixl",))
    policy.hint(small)
    policy.hint(ReceiveResult(8, True, nbytes=1 << 30, fragments=65536, agents=("nixl",)))
    (text,) = _hints(caplog)
    assert "request 7: 65536 fragments of 16384 bytes" in text and "transceiver.staging_arena_bytes" in text
    assert "docs/staging.md" in text


@pytest.mark.parametrize("result", [
    ReceiveResult(1, True, nbytes=1 << 30, fragments=65536, agents=("cuda_ipc",)),  # not NIXL
    ReceiveResult(1, True, nbytes=HINT_MIN_BYTES - 1, fragments=4096, agents=("nixl",)),  # too small to matter
    ReceiveResult(1, True, nbytes=1 << 30, fragments=256, agents=("nixl",)),  # 4 MiB fragments
    ReceiveResult(1, True, nbytes=1 << 30, fragments=32, agents=("nixl",)),  # few fragments
    ReceiveResult(1, False, error="x", error_type="PeerGone", nbytes=1 << 30, fragments=65536, agents=("nixl",)),
], ids=["cuda_ipc", "small", "large-fragments", "few", "failed"])
def test_no_hint_where_descriptors_do_not_bound_the_read(caplog, result):
    caplog.set_level(logging.WARNING, LOGGER)
    StagingPolicy(None, TransceiverConfig()).hint(result)
    assert _hints(caplog) == []


@pytest.mark.parametrize("threshold,min_fragments", [(32 << 10, 64), (8 << 10, 64), (0, 64), (32 << 10, 70000)])
def test_the_hint_follows_the_staged_paths_own_rule_and_settings(caplog, threshold, min_fragments):
    """One rule (formatter.staging.many_small) for the per-piece choice and the hint: a threshold of 0 (the
    staged path off for device memory) or a setting the fragments do not meet keeps the hint silent."""
    from kvbridge.formatter.fragments import Fragments
    from kvbridge.formatter.staging import choose_path

    caplog.set_level(logging.WARNING, LOGGER)
    cfg = TransceiverConfig(staging_threshold_bytes=threshold, staging_min_fragments=min_fragments)
    StagingPolicy(None, cfg).hint(ReceiveResult(3, True, nbytes=1 << 30, fragments=65536, agents=("nixl",)))
    z = np.zeros(65536, dtype=np.int64)
    staged = choose_path(Fragments(z, z, z + (16 << 10)), threshold, min_fragments) == "staged"
    assert staged == (threshold == 32 << 10 and min_fragments == 64)
    assert len(_hints(caplog)) == int(staged)


class _Req:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_a_real_nixl_pull_of_scattered_blocks_hints_once_and_is_exact(caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    lay = KVLayout(KVShape(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32", tokens_per_block=16))
    nb = HINT_MIN_BYTES // lay.block_bytes(0)  # 64 MiB in 4096 blocks of 16 KiB (each one fragment)
    ctx_ids, gen_ids = np.arange(nb, dtype=np.int64)[::-1].copy(), np.arange(nb, dtype=np.int64)  # no runs
    tokens = nb * 16
    ctx_buf = pool_image(lay, 0, nb, [(ctx_ids, tokens, 5)]).copy()
    gen_buf = np.zeros_like(ctx_buf)
    cfg = TransceiverConfig(agents=("nixl",), transfer_timeout_s=60.0)
    with CacheTransceiver.context(ctx_buf, lay, 0, nb, cfg) as ctx, \
            CacheTransceiver.generation(gen_buf, lay, 0, nb, cfg) as gen:
        secret = ctx.respond_and_send_async(_Req(request_id=1, block_ids=ctx_ids, num_tokens=tokens))
        gen.request_and_receive_async(_Req(request_id=1, block_ids=gen_ids, num_tokens=tokens, disagg_params=
                                           DisaggParams(1, ctx.instance, (ctx.endpoint,), lay, secret)))
        (r,) = gen.check_gen_transfer_status(1, timeout_s=60)
        assert r.ok, r
        ctx.check_context_transfer_status(1, timeout_s=10)
    np.testing.assert_array_equal(gen_buf, pool_image(lay, 0, nb, [(gen_ids, tokens, 5)]))
    assert r.agents == ("nixl",) and r.nbytes == HINT_MIN_BYTES and r.fragments >= 4096, r
    (text,) = _hints(caplog)
    assert f"{r.fragments} fragments" in text
