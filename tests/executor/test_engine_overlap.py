"""The engine's side of overlap (docs/overlap.md): a generation-only request submitted without its first token
pulls its KV at once and starts decoding when both its KV and its first token are in, whichever comes last;
a context-only request that asks for it is announced (Started) before the step that prefills it runs."""

from __future__ import annotations

from kvbridge.executor.engine import Engine, Request
from kvbridge.executor.events import Done, GenAlloc, Refused, ReqError, Started, Tok
from kvbridge.executor.plan import Free, Ready, Xfer

LATER = {"first_token_later": True}


def _step(eng, token=1):
    plan = eng.next_plan()
    return plan, eng.step_done(plan, [token] * len(plan.batch))


def _pending(eng, rid=1, max_tokens=3, stream=False):
    eng.submit(Request(rid, [0] * 5, max_tokens=max_tokens, mode="generation_only", ctx_info=dict(LATER),
                       stream=stream))
    plan, events = _step(eng)
    assert isinstance(plan.ops[0], Xfer) and events == [GenAlloc(rid)]
    return eng


def test_without_the_flag_a_generation_request_still_needs_its_first_token():
    eng = Engine(num_blocks=16, tokens_per_block=4)
    eng.submit(Request(1, [0] * 5, max_tokens=3, mode="generation_only"))
    assert eng.take_events() == [Refused(1, "a generation-only request needs the context side's first token")]


def test_kv_first_then_the_token_starts_decoding():
    eng = _pending(Engine(num_blocks=16, tokens_per_block=4), stream=True)
    eng.kv_ready(1)
    assert eng.requests[1].state == "awaiting_token"
    plan, events = _step(eng)
    assert plan.ops == (Ready(1),) and plan.batch == () and events == []
    eng.join(1, 7)
    assert eng.requests[1].state == "running" and eng.requests[1].decode_at > 0
    assert eng.take_events() == [Tok(1, 1, 7)]
    plan, events = _step(eng, token=8)
    assert [b.tokens for b in plan.batch] == [[7]] and events == [Tok(1, 2, 8)]


def test_the_token_first_then_kv_starts_decoding():
    eng = _pending(Engine(num_blocks=16, tokens_per_block=4))
    eng.join(1, 7)
    assert eng.requests[1].state == "awaiting_kv"
    eng.kv_ready(1)
    plan, _ = _step(eng, token=8)
    assert plan.ops == (Ready(1),) and [b.tokens for b in plan.batch] == [[7]]


def test_a_join_of_an_ended_request_is_ignored_and_a_bad_one_is_refused():
    eng = _pending(Engine(num_blocks=16, tokens_per_block=4, vocab_size=32))
    eng.join(99, 3)  # ended (or never here): nothing
    assert eng.take_events() == []
    eng.join(1, 40)  # outside the vocabulary: the request is aborted, its blocks freed once hooks settled
    ev = eng.take_events()
    assert len(ev) == 1 and isinstance(ev[0], Done) and ev[0].reason == "aborted" and "vocabulary" in ev[0].error
    eng.submit(Request(2, [0] * 5, max_tokens=3, mode="generation_only", first_token=3))
    eng.join(2, 4)  # it has its token already
    assert [type(e) for e in eng.take_events()] == [ReqError]


def test_an_abort_while_awaiting_the_token_frees_its_blocks():
    eng = _pending(Engine(num_blocks=16, tokens_per_block=4))
    eng.kv_ready(1)
    _step(eng)
    eng.abort(1, "the router released it")
    assert eng.take_events()[0].reason == "aborted"
    assert eng.next_plan().ops == (Free(1),) and eng.reserved == 0


def test_started_is_announced_before_the_prefill_step_runs_only_when_asked():
    eng = Engine(num_blocks=16, tokens_per_block=4)
    eng.submit(Request(1, [0] * 5, max_tokens=1, mode="context_only", ctx_info={"notify_start": True}))
    eng.submit(Request(2, [0] * 5, max_tokens=1, mode="context_only"))
    eng.next_plan()
    got = eng.take_started()
    assert [type(e) for e in got] == [Started] and got[0].rid == 1 and got[0].t > 0
    assert eng.take_started() == []
