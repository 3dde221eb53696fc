"""A step with no forward lets the workers wait for their pulls (scheduler.py, work.py; real vLLM: the
connector tests and `kvbridge bench vllm`).

vLLM's engine steps without pause while a request waits for remote KV; each empty step takes the core (and the
GIL) the reads run on. The scheduler marks such steps `idle`; a worker with pulls in flight then blocks up to
`idle_wait_ms` for one of them in `get_transfer_results`.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvbridge.formatter.layout import KVLayout, KVShape, ParallelSplit
from kvbridge.integrations.vllm.scheduler import SchedulerSide
from kvbridge.integrations.vllm.work import IDLE_WAIT_MS, StepWork, idle_wait_s

LAYOUT = KVLayout(KVShape(4, 2, 32, "float32", 32), ParallelSplit(1, 1))


def step(tokens: int):
    return SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={},
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                                                                 num_computed_tokens=[]),
                           total_num_scheduled_tokens=tokens)


def test_only_a_step_without_tokens_is_idle():
    s = SchedulerSide("vllm-d", LAYOUT)
    assert s.take_work(step(0)).idle
    assert not s.take_work(step(17)).idle
    assert not s.take_work().idle  # no SchedulerOutput: nothing known, never wait
    assert not StepWork(idle=True)  # an idle flag alone is no work for the workers


@pytest.mark.parametrize("ms,want", [(0, 0.0), (5, 0.005), (2.5, 0.0025), (1000, 1.0), (IDLE_WAIT_MS, 0.005)])
def test_idle_wait_ms_in_range(ms, want):
    assert idle_wait_s(ms) == pytest.approx(want)


@pytest.mark.parametrize("bad", [-1, 1001, "5", None, True, float("nan")])
def test_a_bad_idle_wait_ms_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="idle_wait_ms"):
        idle_wait_s(bad)
