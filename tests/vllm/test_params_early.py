"""Early decode's parameters and the scheduler's bookkeeping, without vLLM (params.py, scheduler.py).

The scheduler is driven with the fields of vLLM's SchedulerOutput it reads (plain values built here); the
real engine runs them in test_connector_early.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvbridge.errors import ProtocolError
from kvbridge.formatter.layout import KVLayout, KVShape, ParallelSplit
from kvbridge.integrations.vllm.params import (EARLY_KEY, KEY, bound_secret, early_publish_of,
                                               remote_prefill_of)
from kvbridge.integrations.vllm.scheduler import SchedulerSide, prompt_hash
from kvbridge.transceiver.params import DisaggParams

LAYOUT = KVLayout(KVShape(4, 2, 32, "float32", 32), ParallelSplit(1, 1))
SECRET = "ab" * 16


def sched() -> SchedulerSide:
    s = SchedulerSide("vllm-p", LAYOUT)
    s.set_workers({0: "tcp://127.0.0.1:1"}, {0: LAYOUT.to_wire()})
    return s


def early(handle=7, secret=SECRET) -> dict:
    return {"do_remote_decode": True, EARLY_KEY: {"ctx_request_id": handle, "secret": secret}}


def step(new=(), cached=(), scheduled=None):
    """The SchedulerOutput fields the connector reads: new (req, blocks, computed), cached (req, more, computed)."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(list(b),), num_computed_tokens=c) for r, b, c in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _, _ in cached], resumed_req_ids=set(),
                                              new_block_ids=[(list(m),) if m else None for _, m, _ in cached],
                                              num_computed_tokens=[c for _, _, c in cached]),
        num_scheduled_tokens=dict(scheduled or {}))


@pytest.mark.parametrize("body,what", [
    ({"ctx_request_id": 0, "secret": SECRET}, "ctx_request_id"),
    ({"ctx_request_id": 1 << 63, "secret": SECRET}, "ctx_request_id"),
    ({"ctx_request_id": True, "secret": SECRET}, "ctx_request_id"),
    ({"ctx_request_id": 5, "secret": "ab" * 8 + "a"}, "secret"),
    ({"ctx_request_id": 5, "secret": "ab" * 15}, "secret"),
    ({"ctx_request_id": 5, "secret": "zz" * 16}, "secret"),
    ("x", EARLY_KEY),
])
def test_bad_early_objects_are_refused_by_name(body, what):
    with pytest.raises(ProtocolError, match=what):
        early_publish_of({"do_remote_decode": True, EARLY_KEY: body})


def test_the_secret_is_bound_to_the_prompt():
    raw = bytes.fromhex(SECRET)
    a, b = bound_secret(raw, prompt_hash([1, 2, 3], 3)), bound_secret(raw, prompt_hash([1, 2, 4], 3))
    assert a != b and len(a) == 16 and a == bound_secret(raw, prompt_hash([1, 2, 3], 3))
    assert bound_secret(bytes(16), prompt_hash([1, 2, 3], 3)) != a


def test_a_chunked_prompt_publishes_in_the_step_of_its_last_chunk_and_answers_when_finished():
    s, prompt = sched(), list(range(100))
    assert s.matched_tokens("r", early(), prompt, 0, max_tokens=1) == (0, False)
    assert not s.take_work(step(new=[("r", [4, 5], 0)], scheduled={"r": 64})).publishes  # first chunk
    work = s.take_work(step(cached=[("r", [9, 2], 64)], scheduled={"r": 36}))
    (pub,) = work.publishes
    assert pub.streamed and pub.handle == 7 and pub.block_ids == (4, 5, 9, 2) and pub.num_tokens == 100
    assert pub.secret == bound_secret(bytes.fromhex(SECRET), prompt_hash(prompt, 100))
    keep, answer = s.request_finished("r", early(), prompt, 100, True, [4, 5, 9, 2])
    assert keep and answer[KEY]["early"] is True and answer[KEY]["ctx_request_id"] == 7
    assert s.take_work().finished == ["r"]
    # the answer, passed to a decode of the same prompt, names the same bound secret
    remote = remote_prefill_of(answer).for_prompt(prompt_hash(prompt, 100), 100)
    assert remote.disagg.secret == pub.secret and remote.num_tokens == 100


def test_an_aborted_early_request_unpublishes_or_frees_at_once():
    s, prompt = sched(), list(range(40))
    s.matched_tokens("a", early(1), prompt, 0, max_tokens=1)
    s.matched_tokens("b", early(2), prompt, 0, max_tokens=1)
    s.take_work(step(new=[("a", [1, 2], 0)], scheduled={"a": 40}))  # a published, b still waiting
    assert s.request_finished("a", early(1), prompt, 0, False, [1, 2]) == (True, None)
    assert s.request_finished("b", early(2), prompt, 0, False, []) == (False, None)
    w = s.take_work()
    assert w.send_cancels == ["a"] and w.finished == ["a"]


def test_early_publish_needs_one_token_and_a_free_handle():
    s, prompt = sched(), list(range(40))
    s.matched_tokens("long", early(3), prompt, 0, max_tokens=8)  # would move on after the forward
    s.matched_tokens("x", early(4), prompt, 0, max_tokens=1)
    s.matched_tokens("dup", early(4), prompt, 0, max_tokens=1)  # another request's handle
    w = s.take_work(step(new=[("long", [1, 2], 0), ("x", [3, 4], 0), ("dup", [5, 6], 0)],
                         scheduled={"long": 40, "x": 40, "dup": 40}))
    assert [p.req_id for p in w.publishes] == ["x"]


def test_an_early_decode_pulls_the_whole_prompt_under_the_bound_secret():
    s = SchedulerSide("vllm-d", LAYOUT)
    d = DisaggParams(9, "vllm-p", ("tcp://127.0.0.1:1",), LAYOUT, bytes.fromhex(SECRET)).to_dict()
    params = {"do_remote_prefill": True, KEY: {**d, "version": 1, "early": True}}
    prompt = list(range(70))
    assert s.matched_tokens("d", params, prompt, 0) == (70, True)
    s.after_alloc("d", [1, 2, 3], 70)
    (pull,) = s.take_work().pulls
    assert pull.num_tokens == 70
    assert bytes.fromhex(pull.disagg["secret"]) == bound_secret(bytes.fromhex(SECRET), prompt_hash(prompt, 70))
    short = {"do_remote_prefill": True, KEY: {**d, "version": 1, "early": True, "secret": "ab" * 8}}
    with pytest.raises(ProtocolError, match="16 bytes"):
        remote_prefill_of(short)
