"""Rank hooks (the transceiver's seat in every rank process): lockstep calls, all-rank consensus, aborts."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from kvbridge.errors import ExecutorError
from kvbridge.executor.hooks import HookReport, HookTally, ReportedStats, validate_report
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


def _reports(*polls: dict) -> list[HookReport]:
    """Each rank's poll() dict, typed as the rank sends it (validate_report), then through its wire form."""
    return [HookReport.from_wire(validate_report({**NONE, **p}, r).to_wire()).checked(r) for r, p in enumerate(polls)]


NONE = {"kv_ready": [], "release": [], "abort": []}


def test_tally_waits_for_every_rank_abort_wins_and_settles_only_when_every_rank_reported():
    t = HookTally(3)
    assert t.add(_reports({"kv_ready": [5]}, {}, {"kv_ready": [5]})).kv_ready == []
    got = t.add(_reports({}, {"kv_ready": [5], "release": [6]}, {}))
    assert got.kv_ready == [5] and got.settled == [5]
    got = t.add(_reports({"release": [6]}, {"abort": [6]}, {}))
    assert got.abort == [6] and got.release == [] and got.settled == []  # rank 2 may still move it
    got = t.add(_reports({}, {}, {"release": [6]}))
    assert got.release == [] and got.abort == [] and got.settled == [6]  # now its blocks may go


def test_an_abort_reason_wins_over_another_ranks_transfer_stats():
    t = HookTally(2)
    t.add(_reports({"kv_ready": [7], "notes": [[7, '{"bytes": 1}']]},
                   {"abort": [7], "notes": [[7, "KV transfer failed (PeerGone): silent"]]}))
    assert t.take_note(7) == "rank 1: KV transfer failed (PeerGone): silent"


def test_transfer_stats_travel_typed_and_the_lowest_ranks_reach_the_request():
    t = HookTally(2)
    s0, s1 = TransferStats(64, 2, ("nixl",), MappingProxyType({"total": 1.5})), TransferStats(32, 1, ("nixl",))
    reports = _reports({"kv_ready": [7, 8], "stats": [[7, s0]]}, {"kv_ready": [7], "stats": [[7, s1]]})
    assert [r.stats for r in reports] == [(ReportedStats(7, s0),), (ReportedStats(7, s1),)]
    assert t.add(reports).kv_ready == [7] and t.take_stats(7) == s0 and t.take_stats(7) is None
    t3 = HookTally(3)
    assert t3.add(_reports({}, {}, {"abort": [8]})).abort == [8]
    t3.add(_reports({"kv_ready": [8], "stats": [[8, s1.to_wire()]]}, {}, {}))  # after the abort: dropped
    assert t3.take_stats(8) is None and not t3.stats
    with pytest.raises(ExecutorError, match=r"rank 1: hook poll\(\)\['stats'\] of request 9: transfer stats: "
                                            r"field 'nbytes'"):
        validate_report({**NONE, "stats": [[9, {**s1.to_wire(), "nbytes": -1}]]}, 1)


def test_a_bad_hook_report_is_refused_naming_the_rank_and_the_field():
    with pytest.raises(ExecutorError, match=r"rank 2: hook poll\(\)\['abort'\] must be a list of request ids"):
        validate_report({**NONE, "abort": [True]}, 2)
    with pytest.raises(ExecutorError, match=r"rank 0: hook poll\(\) must return a dict with keys"):
        validate_report({**NONE, "evict": [1]}, 0)
    with pytest.raises(ExecutorError, match=r"rank 1: hook report 'release' must be request ids"):
        HookReport.from_wire([[], ["x"], []]).checked(1)
    with pytest.raises(ExecutorError, match=r"HookReport.notes"):
        HookReport.from_wire([[], [], [], "not a list"])


def test_a_hook_that_cannot_load_fails_start_with_its_reason():
    with pytest.raises(ExecutorError, match="rank_hook 'no.such.module:make' cannot be loaded"):
        Executor.start(ExecutorConfig(model="seeded:tiny", rank_hook="no.such.module:make", timeout_s=120))
