"""The leader's planner on its own: admission by reservation, FIFO, prefill budget, mode transitions."""

from __future__ import annotations

from kvbridge.executor.engine import Engine, Request
from kvbridge.executor.events import Ctx, Done, GenAlloc, Refused, Released, ReqError
from kvbridge.executor.plan import CtxDone, Free, Ready, Release, Xfer


def _step(eng, token=1):
    plan = eng.next_plan()
    return plan, eng.step_done(plan, [token] * len(plan.batch))


def test_admission_reserves_blocks_to_completion_and_keeps_fifo_order():
    eng = Engine(num_blocks=6, tokens_per_block=4)
    eng.submit(Request(1, [0] * 8, max_tokens=8))   # 16 tokens: 4 blocks
    eng.submit(Request(2, [0] * 4, max_tokens=8))   # 12 tokens: 3 blocks, must wait for request 1
    eng.submit(Request(3, [0] * 1, max_tokens=3))   # would fit, but FIFO keeps it behind request 2
    plan, _ = _step(eng)
    assert [b.rid for b in plan.batch] == [1]
    for _ in range(7):
        plan, events = _step(eng)
    assert [type(e) for e in events] == [Done] and events[0].tokens == [1] * 8
    plan, _ = _step(eng)
    assert plan.ops == (Free(1),) and [b.rid for b in plan.batch] == [2, 3]
    assert eng.reserved == 4


def test_a_request_that_can_never_fit_is_refused_at_once():
    eng = Engine(num_blocks=4, tokens_per_block=4)
    eng.submit(Request(1, [0] * 10, max_tokens=8))
    assert eng.take_events() == [Refused(1, "needs 5 KV blocks to completion, the pool has only 4; request "
                                            "refused")]
    assert not eng.has_work()


def test_prefill_budget_splits_prompts_over_steps_but_never_starves_a_long_one():
    eng = Engine(num_blocks=100, tokens_per_block=4, max_batch_tokens=10)
    eng.submit(Request(1, [0] * 25, max_tokens=2))   # longer than the budget: runs alone
    eng.submit(Request(2, [0] * 6, max_tokens=2))
    eng.submit(Request(3, [0] * 6, max_tokens=2))
    plan, _ = _step(eng)
    assert [b.rid for b in plan.batch] == [1]
    plan, _ = _step(eng)
    assert [(b.rid, len(b.tokens)) for b in plan.batch] == [(1, 1), (2, 6)]


def test_context_and_generation_modes_walk_their_states():
    eng = Engine(num_blocks=16, tokens_per_block=4)
    eng.submit(Request(1, [0] * 5, max_tokens=1, mode="context_only"))
    plan, events = _step(eng, token=9)
    assert plan.batch[0].context_only is True  # pin after the prefill
    assert events == [Ctx(1, first_token=9, num_tokens=5)]
    assert eng.next_plan().ops == (CtxDone(1, 9),)  # every rank's hook hears of it, first token too
    assert not eng.has_work()
    eng.release(1)
    assert eng.take_events() == [Released(1)]
    assert eng.next_plan().ops == (Release(1),) and eng.reserved == 0
    eng.submit(Request(2, [0] * 5, max_tokens=3, mode="generation_only", first_token=9, ctx_info={"a": 1}))
    plan, events = _step(eng)
    assert plan.ops == (Xfer(2, 5, {"a": 1}),) and plan.batch == () and events == [GenAlloc(2)]
    eng.kv_ready(2)
    plan, _ = _step(eng, token=4)
    assert plan.ops == (Ready(2),) and (plan.batch[0].rid, plan.batch[0].start, plan.batch[0].tokens) == (2, 5, [9])
    plan, events = _step(eng, token=5)
    assert events == [Done(2, [9, 4, 5], "length")]
    eng.release(2)
    assert type(eng.take_events()[0]) is ReqError
