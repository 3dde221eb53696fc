"""kvbridge.trtllm driven the way TensorRT-LLM's PyExecutor drives its transceiver: a context process prefills
context-only LlmRequests and offers their KV; this process (generation) pulls it over real ZeroMQ + NIXL into a
pool of another block size, sync and async, polls the status calls, decodes, and gets exactly the aggregated
executor's tokens. Request states are checked at every move."""

from __future__ import annotations

import pytest

from kvbridge.executor.runtime import Executor, ExecutorConfig
from kvbridge.trtllm import LlmRequest, LlmRequestState as S, LlmRequestType, ScheduledRequests

from .pyexec import MODEL, ContextProcess, MiniExecutor

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], list(range(40, 77)), [3, 1, 4, 1, 5, 9, 2, 6]]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def ctx():
    c = ContextProcess()
    yield c
    c.close()


@pytest.fixture
def gen():
    g = MiniExecutor(tokens_per_block=8, instance="gen-instance")
    yield g
    g.close()


def _gen_request(rid: int, prompt: list[int], params: dict, first: int) -> LlmRequest:
    return LlmRequest(rid, prompt, MAX_TOKENS, LlmRequestType.REQUEST_TYPE_GENERATION_ONLY,
                      context_phase_params=params, output_tokens=[first])


def _poll_until_received(gen: MiniExecutor, want: int) -> list[int]:
    done: list[int] = []
    for _ in range(want):  # each call waits (bounded by kv_transfer_timeout_ms) for at least one more
        ok, bad = gen.tr.check_gen_transfer_status(1)
        assert not bad, bad
        done += ok
        if len(done) >= want:
            break
    return done


@pytest.mark.slow
def test_disaggregated_through_the_tensorrt_llm_interfaces_decodes_the_aggregated_tokens(ctx, gen):
    with Executor.start(ExecutorConfig(model=MODEL, num_blocks=64, tokens_per_block=8)) as agg:
        want = agg.generate(PROMPTS, max_tokens=MAX_TOKENS, stop_ids=())
    offered = ctx.ask("prefill", [(100 + i, p) for i, p in enumerate(PROMPTS)])
    assert [s for _, s, _, _ in offered] == ["DISAGG_CONTEXT_TRANS_IN_PROGRESS"] * 3
    reqs = [_gen_request(i, p, params, first) for i, (p, (_, _, params, first)) in enumerate(zip(PROMPTS, offered))]
    assert all(r.state is S.DISAGG_GENERATION_INIT for r in reqs)
    gen.kv.prepare_resources(ScheduledRequests(context_requests=reqs))  # blocks the transfers fill
    for r in reqs[1:]:
        gen.tr.request_and_receive_async(r)
        assert r.state is S.DISAGG_GENERATION_TRANS_IN_PROGRESS
    gen.tr.request_and_receive_sync(reqs[0])  # the async ones may end meanwhile: reported by the next poll
    assert reqs[0].state is S.DISAGG_GENERATION_TRANS_COMPLETE
    assert sorted(_poll_until_received(gen, 2)) == [1, 2]
    assert gen.tr.check_gen_transfer_complete()
    assert all(r.state is S.DISAGG_GENERATION_TRANS_COMPLETE for r in reqs)
    for r in reqs:  # PyExecutor's move once the KV is in: the request decodes from its first token
        r.state = S.GENERATION_IN_PROGRESS
    for _ in range(MAX_TOKENS - 1):
        gen.step(ScheduledRequests(generation_requests=reqs))
    assert [r.output_tokens for r in reqs] == want
    ok, bad, states, free, total = ctx.ask("finish")
    assert (ok, bad) == ([100, 101, 102], [])
    assert {s for s, _ in states.values()} == {"DISAGG_CONTEXT_COMPLETE"}
    assert free == total  # every context block came back once its transfer ended
    for r in reqs:
        gen.kv.free_resources(r)
    assert gen.kv.get_num_free_blocks() == gen.kv.get_max_resource_count()


def test_a_cancelled_context_request_ends_in_error_and_its_blocks_come_back(ctx):
    ((rid, state, _, _),) = ctx.ask("prefill", [(200, PROMPTS[2])])
    assert state == "DISAGG_CONTEXT_TRANS_IN_PROGRESS"
    assert ctx.ask("cancel", rid) is True
    ok, bad, states, free, total = ctx.ask("finish")
    assert (ok, bad) == ([], [200])
    assert states[200][0] == "DISAGG_TRANS_ERROR" and "cancelled" in states[200][1]
    assert free == total


def test_a_pull_of_an_unknown_context_request_ends_in_error_and_frees_cleanly(ctx, gen):
    ((_, _, params, first),) = ctx.ask("prefill", [(300, PROMPTS[0])])
    bogus = dict(params, ctx_request_id=987654)
    r = _gen_request(7, PROMPTS[0], bogus, first)
    gen.kv.prepare_resources(ScheduledRequests(context_requests=[r]))
    gen.tr.request_and_receive_async(r)
    ok, bad = gen.tr.check_gen_transfer_status(None)  # None: wait for every pull in flight
    assert (ok, bad) == ([], [7])
    assert r.state is S.DISAGG_TRANS_ERROR and "has no request 987654" in r.error
    gen.kv.free_resources(r)
    assert gen.kv.get_num_free_blocks() == gen.kv.get_max_resource_count()
    assert gen.tr.cancel_request(r) is False  # nothing in flight any more
    ctx.ask("cancel", 300)
    assert ctx.ask("finish")[1] == [300]


def test_calls_out_of_order_or_after_shutdown_are_refused_by_name(gen):
    r = LlmRequest(1, [1, 2, 3], 2, LlmRequestType.REQUEST_TYPE_GENERATION_ONLY)
    r.state = S.GENERATION_IN_PROGRESS
    with pytest.raises(Exception, match="is GENERATION_IN_PROGRESS, not DISAGG_GENERATION_INIT"):
        gen.tr.request_and_receive_async(r)
    c = LlmRequest(2, [1, 2, 3], 2, LlmRequestType.REQUEST_TYPE_CONTEXT_ONLY)
    c.state = S.DISAGG_GENERATION_INIT
    with pytest.raises(Exception, match="is DISAGG_GENERATION_INIT, not past its context phase"):
        gen.tr.respond_and_send_async(c)
    gen.tr.shutdown()
    with pytest.raises(Exception, match="check_gen_transfer_status: the KvCacheTransceiver was shut down"):
        gen.tr.check_gen_transfer_status(0)


def test_shutdown_with_a_send_in_flight_drops_its_pin_so_the_freed_blocks_come_back():
    ex = MiniExecutor(tokens_per_block=4, instance="ctx-shutdown")
    try:
        r = LlmRequest(9, PROMPTS[0], 1, LlmRequestType.REQUEST_TYPE_CONTEXT_ONLY)
        ex.step(ScheduledRequests(context_requests=[r]))
        ex.tr.respond_and_send_async(r)
        assert ex.tr.check_context_transfer_status(0) == ([], [])  # nobody pulled it: still in flight
        ex.kv.free_resources(r)  # the executor gives up on it; the pin keeps the blocks until the send ends
        assert ex.kv.get_num_free_blocks() < ex.kv.get_max_resource_count()
    finally:
        ex.close()
    assert r.state is S.DISAGG_TRANS_ERROR and "shut down" in r.error
    assert ex.kv.get_num_free_blocks() == ex.kv.get_max_resource_count()


def test_cancelling_a_pull_in_flight_ends_it_in_error_and_its_blocks_can_be_freed(ctx, gen):
    import zmq

    ((_, _, params, first),) = ctx.ask("prefill", [(400, PROMPTS[1])])
    silent = zmq.Context.instance().socket(zmq.ROUTER)  # fault injection: a context rank that never answers
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind("tcp://127.0.0.1:*")
    try:
        r = _gen_request(11, PROMPTS[1], dict(params, endpoints=[silent.getsockopt_string(zmq.LAST_ENDPOINT)]),
                         first)
        gen.kv.prepare_resources(ScheduledRequests(context_requests=[r]))
        gen.tr.request_and_receive_async(r)
        assert gen.tr.check_gen_transfer_status(0) == ([], []) and not gen.tr.check_gen_transfer_complete()
        assert gen.tr.cancel_request(r) is True
        assert gen.tr.check_gen_transfer_status(None) == ([], [11])
    finally:
        silent.close()
    assert r.state is S.DISAGG_TRANS_ERROR and "cancel" in r.error.lower()
    gen.kv.free_resources(r)
    assert gen.kv.get_num_free_blocks() == gen.kv.get_max_resource_count()
    ctx.ask("cancel", 400)
    assert ctx.ask("finish")[1] == [400]
