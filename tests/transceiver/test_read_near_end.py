"""The receiver looks at reads in flight without pausing only while one may end about now: from shortly before
its transport's earliest possible end (TransferHandle.earliest_end: posted + bytes at the transport's peak
rate, cuda_ipc's 400 GB/s) to a bounded time after it; a transport that gives no bound keeps the pause."""

from __future__ import annotations

import time

from kvbridge.agents import XferState
from kvbridge.agents.handles import TransferHandle
from kvbridge.transceiver import pull as pull_mod

from .test_pull_posts import Handle, _pull


class Timed(TransferHandle):
    peak_bps = 400e9

    def __init__(self, nbytes: int, posted_at: float) -> None:
        super().__init__(1, nbytes)
        self.posted_at = posted_at

    def state(self) -> XferState:
        return XferState.PENDING


def test_earliest_end_is_posted_plus_bytes_at_the_peak_rate_or_none():
    h = Timed(1 << 30, 100.0)
    assert abs(h.earliest_end() - (100.0 + (1 << 30) / 400e9)) < 1e-12
    Timed.peak_bps = 0.0
    try:
        assert h.earliest_end() is None  # the base class's default: no bound
    finally:
        Timed.peak_bps = 400e9
    h.release()


def test_a_pull_is_near_its_end_only_around_a_reads_earliest_possible_end():
    pull, _ = _pull()
    leg = next(iter(pull.legs.values()))
    t0 = time.monotonic()
    leg.handles.append(Handle())  # a fake without earliest_end: never near
    assert not pull.near_end(t0)
    h = Timed(1 << 30, t0)  # 1 GiB: ~2.68 ms at best
    leg.handles.append(h)
    end = h.earliest_end()
    assert not pull.near_end(t0)  # just posted: pause between looks
    assert pull.near_end(end - pull_mod._NEAR_S / 2)
    assert pull.near_end(end + pull_mod._LATE_S / 2)
    assert not pull.near_end(end + 2 * pull_mod._LATE_S)  # long late: back to pausing
    h.release()
