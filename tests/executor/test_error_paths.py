"""Error paths of disaggregated executors (real rank processes, the transceiver over NIXL between them): each
test checks the error text, how long it took to detect, and that every pool ends full.

    bad disagg_params         the generation request aborts with the field named; the executor keeps serving
    token-count mismatch      the pull fails naming both counts; the context request is released
    a rank process dying      every later call raises naming the rank and its exit; detected within a bound
    closed while waited on    the waiter gets "the executor was closed" at once, not at its timeout
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest

from kvbridge.errors import ExecutorError
from kvbridge.executor.runtime import Executor, ExecutorConfig
from kvbridge.executor.transceiver_hook import context_endpoints, disagg_params, hooked_executor_config
from kvbridge.transceiver import DisaggParams

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
XCFG = {"agents": ["nixl"], "transfer_timeout_s": 30, "pickup_timeout_s": 10}


def _exec(tmp_path, role, tag, **kw) -> Executor:
    run_dir = tmp_path / tag
    run_dir.mkdir()
    return Executor.start(hooked_executor_config(role, f"{tag}-instance", run_dir, XCFG, model="seeded:tiny3",
                                                 timeout_s=120, num_blocks=16, **kw))


def test_bad_disagg_params_abort_the_request_with_the_field_named_and_the_executor_goes_on(tmp_path):
    with _exec(tmp_path, "context", "ctx", tokens_per_block=4) as ctx, \
            _exec(tmp_path, "generation", "gen", tp=2, tokens_per_block=8) as gen:
        good = DisaggParams(1, "ctx-instance", context_endpoints(str(tmp_path / "ctx"), 1), ctx.layout).to_dict()
        cases = [
            ({}, "no disagg_params in ctx_info"),
            ({"disagg_params": "ctx0"}, "ProtocolError: disaggregated params: expected an object"),
            ({"disagg_params": {k: v for k, v in good.items() if k != "endpoints"}},
             "disaggregated params: missing field 'endpoints'"),
            ({"disagg_params": {**good, "ctx_request_id": True}},
             "disaggregated params: field 'ctx_request_id' should be int"),
            ({"disagg_params": {**good, "endpoints": ["http://127.0.0.1:1"]}},
             "endpoints must be 1..4096 'tcp://host:port' strings"),
        ]
        for ctx_info, text in cases:
            t0 = time.monotonic()
            rid = gen.submit(PROMPT, max_tokens=4, mode="generation_only", first_token=1, ctx_info=ctx_info)
            c = gen.wait(rid, timeout=60)
            took = time.monotonic() - t0
            assert c.finish_reason == "aborted" and text in c.error, (ctx_info, c.error)
            assert took < 10, f"{text}: detected after {took:.1f} s (it needs no network at all)"
        assert gen.free_blocks() == [16, 16]
        res = ctx.prefill(PROMPT)  # the generation executor still serves a good request
        params = disagg_params(ctx, res.request_id, good["endpoints"]).to_dict()
        rid = gen.submit(PROMPT, max_tokens=4, mode="generation_only", first_token=res.first_token,
                         ctx_info={"disagg_params": params})
        assert gen.wait(rid, timeout=60).finish_reason != "aborted"
        assert gen.free_blocks() == [16, 16] and ctx.free_blocks(timeout=30) == [16]


def test_a_token_count_mismatch_fails_the_pull_naming_both_counts_and_frees_both_sides(tmp_path):
    with _exec(tmp_path, "context", "ctx", tokens_per_block=4) as ctx, \
            _exec(tmp_path, "generation", "gen", tokens_per_block=8) as gen:
        endpoints = context_endpoints(str(tmp_path / "ctx"), 1)
        res = ctx.prefill(PROMPT)
        params = disagg_params(ctx, res.request_id, endpoints).to_dict()
        t0 = time.monotonic()
        rid = gen.submit(PROMPT[:-1], max_tokens=4, mode="generation_only", first_token=res.first_token,
                         ctx_info={"disagg_params": params})
        c = gen.wait(rid, timeout=60)
        took = time.monotonic() - t0
        assert c.finish_reason == "aborted"
        assert (f"context rank 0 holds {len(PROMPT)} tokens of request {params['ctx_request_id']}, the generation "
                f"side expects {len(PROMPT) - 1}") in c.error, c.error
        assert took < XCFG["transfer_timeout_s"], f"detected after {took:.1f} s: at the handover, not a timeout"
        assert gen.free_blocks() == [16]
        deadline = time.monotonic() + XCFG["pickup_timeout_s"] + 20  # the failed read releases the context side
        while (free := ctx.free_blocks()) != [16]:
            assert time.monotonic() < deadline, f"context blocks never came back: {free}"
            time.sleep(0.1)


def _rank_pids(before: set[int]) -> list[int]:
    return sorted(p.pid for p in mp.active_children() if p.pid not in before)


def test_a_rank_process_dying_mid_run_fails_every_call_naming_the_rank(tmp_path):
    before = {p.pid for p in mp.active_children()}
    with Executor.start(ExecutorConfig(model="seeded:tiny3", tp=2, num_blocks=260, tokens_per_block=16,
                                       timeout_s=60)) as ex:
        pids = _rank_pids(before)
        assert len(pids) == 2
        rid = ex.submit(PROMPT, max_tokens=4000, stop_ids=(), stream=True)  # still decoding when the rank dies
        toks, done = ex.wait_tokens(rid, 0, timeout=60)
        assert toks and done is None  # it is running
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        # the killed rank's exit, or its peer's collective failing on the broken link, whichever is seen first
        with pytest.raises(ExecutorError, match=r"rank \d (exited \(exit code -9, killed by signal 9\)|failed: )"):
            ex.wait(rid, timeout=60)
        assert time.monotonic() - t0 < 30, "a dead rank must be seen within the collective timeout"
        assert ex.error is not None
        with pytest.raises(ExecutorError):  # and every later call says so at once
            ex.submit(PROMPT, max_tokens=2)
    for pid in pids:  # close() reaps what is left: no rank outlives its executor
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_wait_on_an_executor_closed_by_another_thread_ends_at_once_naming_the_close():
    """close() from one thread while another waits (here: for the end of a long request): the waiter gets
    ExecutorError "the executor was closed" within a second, not at its 60 s timeout (the soak's restart)."""
    import threading

    with Executor.start(ExecutorConfig(model="seeded:tiny3", num_blocks=260, tokens_per_block=16,
                                       timeout_s=60)) as ex:
        rid = ex.submit(PROMPT, max_tokens=4000, stop_ids=(), stream=True)
        assert ex.wait_tokens(rid, 0, timeout=60)[0]  # running
        got: list = []

        def waiter():
            try:
                ex.wait(rid, timeout=60)
            except ExecutorError as e:
                got.append((str(e), time.monotonic()))

        t = threading.Thread(target=waiter)
        t.start()
        time.sleep(0.2)
        t_close = time.monotonic()
        ex.close()
        t.join(30)
        assert got and "the executor was closed" in got[0][0], got
        assert got[0][1] - t_close < 2.0, "the waiter sat out its timeout"
