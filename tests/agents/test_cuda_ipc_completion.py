"""How a cuda_ipc READ notices its end (issue 24, one READ at 350 GB/s): pipelined parts that run in order on one
stream are polled in order (one event query per poll, not one per part), a failed part still settles the
whole only once nothing can move, and `wait` sleeps only well before the expected end, then polls without
sleeping (time.sleep overshoots by 50-80 us on the GPU hosts, even sleep(0)), never past its deadline.
Pure handle logic: fake parts, no CUDA."""

from __future__ import annotations

import time

import pytest
from kvbridge.agents import XferState
from kvbridge.agents import cuda_handles as cuda_ipc  # the handles' module (cuda_ipc re-exports them)
from kvbridge.agents.cuda_handles import CudaIpcChunked, _await_end
from kvbridge.agents.handles import TransferHandle
from kvbridge.errors import TransferTimeout

P, D, F = XferState.PENDING, XferState.DONE, XferState.FAILED


class Part(TransferHandle):
    """A part whose state the test sets; counts polls and cancels. Becomes DONE after `done_after` polls."""

    def __init__(self, nbytes: int = 1 << 20, done_after: int | None = None) -> None:
        super().__init__(1, nbytes)
        self.now, self.polls, self.cancels, self.done_after = P, 0, 0, done_after

    def state(self) -> XferState:
        self.polls += 1
        if self.done_after is not None and self.polls >= self.done_after:
            self.now = D
        return self.now

    def _cancel(self) -> None:
        self.cancels += 1


def test_pipelined_parts_are_polled_in_order_and_a_pending_one_ends_the_poll():
    parts = [Part(), Part(), Part()]
    h = CudaIpcChunked(parts)
    assert h.state() is P
    assert [p.polls for p in parts] == [1, 0, 0]  # the later parts run after the first on the same stream
    parts[0].now = D
    assert h.state() is P
    assert [p.polls for p in parts] == [2, 1, 0]
    assert h.state() is P
    assert parts[0].polls == 2  # a part seen DONE is not asked again
    parts[1].now = parts[2].now = D
    assert h.state() is D
    assert h.nbytes == 3 << 20 and h.posted_at == parts[0].posted_at


def test_a_failed_part_cancels_the_rest_and_the_whole_fails_only_once_none_still_runs():
    parts = [Part(), Part(), Part()]
    h = CudaIpcChunked(parts)
    parts[0].now = F
    parts[0].error = "the copy kernel failed: CUDA_ERROR_ILLEGAL_ADDRESS"
    assert h.state() is P  # parts 1 and 2 may still move data
    assert parts[1].cancels == 1 and parts[2].cancels == 1
    parts[1].now = parts[2].now = F
    assert h.state() is F
    assert "ILLEGAL_ADDRESS" in h.error


def test_near_the_end_wait_polls_without_sleeping(monkeypatch):
    sleeps: list[float] = []
    monkeypatch.setattr(cuda_ipc.time, "sleep", sleeps.append)
    monkeypatch.setattr(cuda_ipc, "_SPIN_S", 60.0)  # a loaded box's 50 yields may outlast 2 ms: not this test's
    h = Part(nbytes=1, done_after=50)  # expected end already passed: no sleep at all
    _await_end(h, time.monotonic() + 30.0)
    assert h.now is D and h.polls == 50 and sleeps == []


def test_wait_sleeps_once_through_the_time_the_copy_must_take_then_polls(monkeypatch):
    sleeps: list[float] = []
    monkeypatch.setattr(cuda_ipc.time, "sleep", sleeps.append)  # returns at once: the poll loop follows
    monkeypatch.setattr(cuda_ipc, "_SPIN_S", 60.0)
    h = Part(nbytes=1 << 30, done_after=3)
    _await_end(h, time.monotonic() + 30.0)
    assert len(sleeps) == 1 and h.now is D
    floor = (1 << 30) / cuda_ipc._FAST_NVLINK  # 2.7 ms: no copy of 1 GiB between GPUs ends sooner
    assert floor - cuda_ipc._WAKE_EARLY - 0.5 < sleeps[0] <= floor - cuda_ipc._WAKE_EARLY


def test_a_chunked_wait_never_passes_its_deadline():
    h = CudaIpcChunked([Part(), Part()])
    t0 = time.monotonic()
    with pytest.raises(TransferTimeout):
        h.wait(0.05)
    assert time.monotonic() - t0 < 5.0  # generous: a loaded box, but nothing near the 30 s a hang would take
    with pytest.raises(TransferTimeout):
        CudaIpcChunked([Part(nbytes=1 << 40)]).wait(0.05)  # a long expected copy still honours the deadline
