"""A decode request pulls its remote KV once (scheduler.py, without vLLM; the real engine: test_connector_pd.py).

vLLM asks the connector again (get_num_new_matched_tokens) whenever it schedules a waiting request, and a
request preempted for memory after its pull is waiting again, with its blocks freed. The prefill engine let its
blocks go when the pull confirmed, so a second pull could only fail the request (`RequestNotFound`): the
request computes its prompt locally instead, as after any local-cache miss.
"""

from __future__ import annotations

from kvbridge.formatter.layout import KVLayout, KVShape, ParallelSplit
from kvbridge.integrations.vllm.params import KEY
from kvbridge.integrations.vllm.scheduler import SchedulerSide
from kvbridge.transceiver.params import DisaggParams

LAYOUT = KVLayout(KVShape(4, 2, 32, "float32", 32), ParallelSplit(1, 1))
PROMPT = list(range(70))


def remote_prefill() -> dict:
    d = DisaggParams(9, "vllm-p", ("tcp://127.0.0.1:1",), LAYOUT, b"\xab" * 16).to_dict()
    return {"do_remote_prefill": True, "do_remote_decode": False, KEY: {**d, "version": 1, "num_tokens": 70}}


def pulled(s: SchedulerSide, req: str, params: dict) -> None:
    assert s.matched_tokens(req, params, PROMPT, 0) == (70, True)
    s.after_alloc(req, [1, 2, 3], 70)
    assert len(s.take_work().pulls) == 1


def test_a_request_scheduled_again_after_its_pull_computes_locally():
    s, params = SchedulerSide("vllm-d", LAYOUT), remote_prefill()
    pulled(s, "r", params)
    s.worker_reports({}, {"r"})
    assert s.matched_tokens("r", params, PROMPT, 0) == (0, False)  # preempted, waiting again: no second pull
    s.after_alloc("r", [4, 5, 6], 0)
    assert not s.take_work().pulls
    s.request_finished("r", params, PROMPT, 78, True, [4, 5, 6])
    pulled(s, "r", params)  # the id, reused by a later request, pulls again


def test_a_failed_pull_is_not_retried_either():
    s, params = SchedulerSide("vllm-d", LAYOUT), remote_prefill()
    pulled(s, "r", params)
    s.worker_reports({}, {"r"})  # the workers report a failed load as finished too
    assert s.matched_tokens("r", params, PROMPT, 0) == (0, False)


def test_a_pull_aborted_before_its_report_leaves_nothing_behind():
    s, params = SchedulerSide("vllm-d", LAYOUT), remote_prefill()
    pulled(s, "r", params)
    s.request_finished("r", params, PROMPT, 0, False, [1, 2, 3])  # aborted while its KV arrives
    assert s.take_work().cancels == ["r"]
    s.worker_reports({}, {"r"})  # the cancelled pull reports afterwards
    assert not (s._loaded or s._seen or s._pulling or s._local)


def test_a_decode_finished_before_its_pull_began_is_withdrawn_once_and_only_then():
    """Aborted while it waited (never scheduled, or scheduled but not yet allocated), or never needing the pull:
    the workers withdraw it (Receiver.withdraw), so the prefill engine frees its KV now, not at its pickup
    timeout. A request that pulled, is pulling, or names no remote prefill withdraws nothing."""
    s, params = SchedulerSide("vllm-d", LAYOUT), remote_prefill()
    s.request_finished("never-scheduled", params, PROMPT, 0, False, [])
    assert s.matched_tokens("waiting", params, PROMPT, 0) == (70, True)  # asked, then aborted before its blocks
    s.request_finished("waiting", params, PROMPT, 0, False, [])
    w = s.take_work()
    assert [(DisaggParams.from_dict(d).ctx_request_id, n) for d, n in w.withdraws] == [(9, 70), (9, 70)]
    assert not w.cancels
    pulled(s, "pulling", params)
    s.request_finished("pulling", params, PROMPT, 0, False, [1, 2, 3])  # cancelled, not withdrawn
    w = s.take_work()
    assert w.cancels == ["pulling"] and not w.withdraws
    pulled(s, "done", params)
    s.worker_reports({}, {"done"})
    s.request_finished("done", params, PROMPT, 78, True, [1, 2, 3])
    s.request_finished("local", {}, PROMPT, 70, True, [1, 2, 3])  # no remote prefill at all
    assert not s.take_work().withdraws
