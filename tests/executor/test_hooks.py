"""Rank hooks (the transceiver's seat in every rank process): lockstep calls, all-rank consensus, aborts."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from kvbridge.errors import ExecutorError
from kvbridge.executor.hooks import HookTally, validate_report
from kvbridge.transceiver.stats import TransferStats
from kvbridge.executor.runtime import Executor, ExecutorConfig

PROMPT = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]


def _cfg(tmp_path, role, **kw):
    return ExecutorConfig(model="seeded:tiny", num_blocks=16, tokens_per_block=4, timeout_s=60,
                          rank_hook="tests.executor.file_hook:make", rank_hook_args={"dir": str(tmp_path),
                                                                                     "role": role},
                          **kw)


def test_hooks_move_kv_between_executors_and_every_rank_must_agree(tmp_path):
    with Executor.start(ExecutorConfig(model="seeded:tiny", num_blocks=16, tokens_per_block=4)) as agg:
        want = agg.generate([PROMPT], max_tokens=8)[0]
    with Executor.start(_cfg(tmp_path, "ctx", tp=2)) as ctx, Executor.start(_cfg(tmp_path, "gen",
                                                                                 tp=2)) as gen:
        res = ctx.prefill(PROMPT)
        # every ctx rank reported "release": the leader released the request by itself
        ctx.wait_released(res.request_id, 30)
        rid = gen.submit(PROMPT, max_tokens=8, mode="generation_only", first_token=res.first_token,
                         ctx_info={"ctx_rid": res.request_id, "first_token": res.first_token})
        assert gen.wait(rid).tokens == want  # kv_ready came from the hooks of both gen ranks
        bad = gen.submit(PROMPT, max_tokens=8, mode="generation_only", first_token=res.first_token,
                         ctx_info={"fail": True})
        assert gen.wait(bad).finish_reason == "aborted"
        assert ctx.free_blocks() == [16, 16] and gen.free_blocks() == [16, 16]


def test_tally_waits_for_every_rank_abort_wins_and_settles_only_when_every_rank_reported():
    t = HookTally(3)
    none = {"kv_ready": [], "release": [], "abort": []}
    assert t.add([{**none, "kv_ready": [5]}, none, {**none, "kv_ready": [5]}])["kv_ready"] == []
    got = t.add([none, {**none, "kv_ready": [5], "release": [6]}, none])
    assert got["kv_ready"] == [5] and got["settled"] == [5]
    got = t.add([{**none, "release": [6]}, {**none, "abort": [6]}, none])
    assert got["abort"] == [6] and got["release"] == [] and got["settled"] == []  # rank 2 may still move it
    got = t.add([none, none, {**none, "release": [6]}])
    assert got["release"] == [] and got["abort"] == [] and got["settled"] == [6]  # now its blocks may go


def test_an_abort_reason_wins_over_another_ranks_transfer_stats():
    t = HookTally(2)
    none = {"kv_ready": [], "release": [], "abort": []}
    t.add([{**none, "kv_ready": [7], "notes": [[7, '{"bytes": 1}']]},
           {**none, "abort": [7], "notes": [[7, "KV transfer failed (PeerGone): silent"]]}])
    assert t.take_note(7) == "rank 1: KV transfer failed (PeerGone): silent"


def test_transfer_stats_travel_typed_and_the_lowest_ranks_reach_the_request():
    t = HookTally(2)
    none = {"kv_ready": [], "release": [], "abort": []}
    s0, s1 = TransferStats(64, 2, ("nixl",), MappingProxyType({"total": 1.5})), TransferStats(32, 1, ("nixl",))
    reports = [validate_report({**none, "kv_ready": [7, 8], "stats": [[7, s0]]}, 0),
               validate_report({**none, "kv_ready": [7], "stats": [[7, s1]]}, 1)]
    assert [r["stats"] for r in reports] == [[[7, s0.to_wire()]], [[7, s1.to_wire()]]]  # plain data to gather
    assert t.add(reports)["kv_ready"] == [7] and t.take_stats(7) == s0 and t.take_stats(7) is None
    t3 = HookTally(3)
    assert t3.add([none, none, {**none, "abort": [8]}])["abort"] == [8]
    t3.add([{**none, "kv_ready": [8], "stats": [[8, s1.to_wire()]]}, none, none])  # after the abort: dropped
    assert t3.take_stats(8) is None and not t3.stats
    with pytest.raises(ExecutorError, match=r"rank 1: hook poll\(\)\['stats'\] of request 9: transfer stats: "
                                            r"field 'nbytes'"):
        validate_report({**none, "stats": [[9, {**s1.to_wire(), "nbytes": -1}]]}, 1)


def test_a_hook_that_cannot_load_fails_start_with_its_reason():
    with pytest.raises(ExecutorError, match="rank_hook 'no.such.module:make' cannot be loaded"):
        Executor.start(ExecutorConfig(model="seeded:tiny", rank_hook="no.such.module:make", timeout_s=120))
