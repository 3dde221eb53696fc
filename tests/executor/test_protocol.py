"""The executor's internal protocol: every message type round-trips through its wire form (and msgpack), and
a wrong version, an unknown kind or a bad field is refused with an ExecutorError that names it."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

import pytest

from kvbridge import codec
from kvbridge.errors import ExecutorError, ProtocolError
from kvbridge.executor import events as E
from kvbridge.executor import pipe_messages as pm
from kvbridge.executor import plan as P
from kvbridge.executor.connector.wire import ConnReport, ConnSection
from kvbridge.executor.kv_check import KVDigest, RankDigest
from kvbridge.executor.sampling import SamplingParams, TokenHistory, TokenLogprob
from kvbridge.transceiver.stats import TransferStats

SP = SamplingParams(temperature=0.7, top_k=5, seed=3, min_tokens=2, logprobs=1)
LP = TokenLogprob(-0.5, ((7, -0.5), (3, -1.25)))
STATS = TransferStats(4096, 12, ("nixl", "nixl"), MappingProxyType({"total": 3.5, "read": 1.25}))
ROW = P.BatchRow(4, 16, [5, 6, 7], True, False, SP, TokenHistory((1, 2), (3,), (9,)))

OPS = [P.Reuse(1, [1, 2, 3, 4], 4), P.Xfer(2, 9, {"disagg_params": {"x": 1}}, 4, [1, 2, 3]), P.Xfer(3, 5, {}),
       P.ConnAlloc(4, 8, [1, 2, 3, 4]), P.ConnAlloc(5, 8), P.Ready(6), P.CtxDone(7, 42), P.Free(8),
       P.Release(9), P.Write(10), P.HookAbort(11)]
POSTS = [P.Read(1), P.Drop(2), P.Digest(3), P.Stats()]
EVENTS = [E.Ctx(1, 42, 17, [3, 4, 5], LP, 8, 4), E.Ctx(2, 1, 1), E.GenAlloc(3, [0, 1]),
          E.Done(4, [1, 2, 3], "length", "", STATS, 0, 4, (LP, LP)), E.Done(5, [], "aborted", "gone"),
          E.Tok(6, 2, 9, LP), E.Tok(7, 1, 9), E.Refused(8, "too big"), E.ReqError(9, "unknown"), E.Released(10)]
DIGEST = KVDigest(5, "float32", MappingProxyType({(0, 0): ("aa", "bb"), (1, 0): ("cc", "dd")}))
COMMANDS = [pm.Add(1, [1, 2, 3], 8, "generation_only", SP, [0], 7, {"k": "v"}, True),
            pm.Add(2, [1], 1, "aggregated", SamplingParams(), [], None, {}), pm.KvReady(3), pm.Release(4),
            pm.Abort(5), pm.ReadKv(6), pm.WriteKv(7), pm.QueryStats(), pm.QueryDigest(8), pm.Stop(),
            pm.KvShard(9, [2, 2, 1, 3, 4], "float32")]
REPLIES = [pm.RankReady(0, {"hidden_size": 8}, {"shape": {}}, 1234), pm.KvShard(9, [1, 2], "bfloat16", 1),
           pm.RankStats(1, 10, [3, 4], 2, 16), pm.RankExit(1), pm.RankError(1, "boom", "tb"),
           RankDigest(3, 1, DIGEST), RankDigest(3, 0, None, "never recorded"), *EVENTS]


def _through_msgpack(wire):
    return codec.unpack(codec.pack(wire))


@pytest.mark.parametrize("op", OPS + POSTS, ids=lambda o: type(o).__name__)
def test_every_op_round_trips_in_a_plan(op):
    post = isinstance(op, tuple(type(p) for p in POSTS))
    plan = P.StepPlan(3, False, () if post else (op,), (ROW,), (op,) if post else (), 17, ConnSection(None, (1,), ()))
    assert P.StepPlan.from_wire(_through_msgpack(plan.to_wire())) == plan


def test_an_empty_and_a_stop_plan_round_trip():
    for plan in (P.StepPlan.empty(9), P.StepPlan.empty(9, stop=True),
                 P.StepPlan.empty(1, conn=ConnSection({"a": [1]}, (3,), (4, 5)))):
        assert P.StepPlan.from_wire(_through_msgpack(plan.to_wire())) == plan


@pytest.mark.parametrize("msg", COMMANDS, ids=lambda m: type(m).__name__)
def test_every_command_round_trips(msg):
    for payload in (False, True):
        assert pm.decode_command(_through_msgpack(pm.encode(msg, payload))) == (msg, payload)


@pytest.mark.parametrize("msg", REPLIES, ids=lambda m: type(m).__name__)
def test_every_reply_and_event_round_trips(msg):
    assert pm.decode_reply(_through_msgpack(pm.encode(msg))) == (msg, False)


def test_transfer_stats_round_trip_and_show_the_response_form():
    assert TransferStats.from_wire(_through_msgpack(STATS.to_wire())) == STATS
    assert STATS.as_json() == {"bytes": 4096, "fragments": 12, "agents": ["nixl", "nixl"],
                               "ms": {"total": 3.5, "read": 1.25}}


def _plan_wire(**change):
    w = P.StepPlan(3, False, (P.Free(1),), (ROW,), (P.Read(2),)).to_wire()
    for path, value in change.items():
        *outer, last = [int(i) for i in path.split("_")[1:]]
        inner = w
        for i in outer:
            inner = inner[i]
        inner[last] = value
    return w


@pytest.mark.parametrize("change, text", [
    ({"at_0": 1}, "step plan: version 1, expected 2"),
    ({"at_1": "3"}, "step plan field 'step' is '3', expected int"),
    ({"at_2": 0}, "step plan field 'stop' is 0, expected bool"),
    ({"at_3_0_0": "evict"}, "step plan op: unknown kind 'evict'"),
    ({"at_5_0_0": "free"}, "step plan post op: unknown kind 'free'"),
    ({"at_3_0_1": True}, "Free.rid is True, expected int"),
    ({"at_4_0_3": 1}, "BatchRow.sample is 1, expected bool"),
    ({"at_4_0_5": {"v": 99}}, "BatchRow.sampling: sampling params: wire version 99"),
    ({"at_4_0_2": "abc"}, "BatchRow.tokens is 'abc', expected list"),
])
def test_a_bad_plan_is_refused_naming_what_was_wrong(change, text):
    with pytest.raises(ExecutorError, match=text):
        P.StepPlan.from_wire(_plan_wire(**change))


def test_a_row_or_op_with_missing_or_extra_fields_is_refused():
    with pytest.raises(ExecutorError, match=r"BatchRow: 3 fields, expected 6..7"):
        P.BatchRow.from_wire([1, 2, [3]])
    with pytest.raises(ExecutorError, match=r"CtxDone: 3 fields, expected 2..2"):
        P.OPS.decode(["ctx_done", 1, 2, 3])


@pytest.mark.parametrize("frame, text", [
    ([99, False, "abort", 1], "executor frame: version 99, expected 1"),
    ([pm.PIPE_VERSION, 0, "abort", 1], "has_payload is 0, expected bool"),
    ([pm.PIPE_VERSION, False, "launch", 1], "command: unknown kind 'launch'"),
    ([pm.PIPE_VERSION, False, "done", 1, [], "stop"], "command: unknown kind 'done'"),  # an event is no command
    ([pm.PIPE_VERSION, False, "abort", "1"], "Abort.rid is '1', expected int"),
    ([pm.PIPE_VERSION, False, "add", 1, [1], 4, "aggregated", SP.to_wire(), [], "7", {}],
     "Add.first_token is '7', expected int"),
    ({"t": "abort"}, "expected \\[version, has_payload, kind"),
])
def test_a_bad_command_frame_is_refused_naming_what_was_wrong(frame, text):
    with pytest.raises(ExecutorError, match=text):
        pm.decode_command(frame)


@pytest.mark.parametrize("frame, text", [
    ([pm.PIPE_VERSION, False, "stop"], "rank reply: unknown kind 'stop'"),
    ([pm.PIPE_VERSION, False, "done", 4, [1], "length", "", {"v": 7}], "Done.transfer: transfer stats: version 7"),
    ([pm.PIPE_VERSION, False, "tok", 1, 1, 2, [0.5, "x"]], "Tok.lp: token logprob"),
    ([pm.PIPE_VERSION, False, "kv_digest", 3, 1, [2, 5, "f", [], []], ""], "KV digest: version 2"),
])
def test_a_bad_reply_frame_is_refused_naming_what_was_wrong(frame, text):
    with pytest.raises(ExecutorError, match=text):
        pm.decode_reply(frame)


@pytest.mark.parametrize("wire, text", [
    ({"v": 2}, "version 2"),
    ({"v": 1, "nbytes": True, "fragments": 0, "agents": [], "ms": {}}, "'nbytes'"),
    ({"v": 1, "nbytes": 1, "fragments": 0, "agents": [1], "ms": {}}, "'agents'"),
    ({"v": 1, "nbytes": 1, "fragments": 0, "agents": [], "ms": {"total": "3"}}, "'ms'"),
])
def test_bad_transfer_stats_are_refused_naming_the_field(wire, text):
    with pytest.raises(ProtocolError, match=text):
        TransferStats.from_wire(wire)


def test_messages_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        P.Free(1).rid = 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        E.Released(1).rid = 2


def test_the_connector_section_and_report_round_trip_and_name_bad_fields():
    sec = ConnSection(None, (1, 2), ())
    assert ConnSection.from_wire(sec.to_wire()) == sec
    rep = ConnReport((1,), (2,), ((2, "disk full"),))
    assert ConnReport.from_wire(rep.to_wire(), 3) == rep
    with pytest.raises(ExecutorError, match=r"step plan field 'conn': plan connector section 'saving' must be "):
        P.StepPlan.from_wire(P.StepPlan.empty(1, conn=sec).to_wire()[:7] + [[1, None, ["x"], []]])
    with pytest.raises(ProtocolError, match=r"rank 3 connector report: 'errors' must be"):
        ConnReport.from_wire([[], [], [[1]]], 3)
