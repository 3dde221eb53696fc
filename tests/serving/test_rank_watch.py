"""The probe behind a worker's `stalled` (serving/backend.py `ranks_answer`, worker_state.watch_ranks) on a
real executor: it answers at once while every request thread of the worker is taken, and says no while the
rank process is stopped (SIGSTOP), yes again once it runs. The whole path under `kvbridge serve`:
tests/serving/test_supervision.py."""

from __future__ import annotations

import asyncio
import threading
import time

from kvbridge.executor.runtime import Executor, ExecutorConfig
from kvbridge.serving.backend import Backend

from .faults import stopped


def test_the_rank_probe_needs_no_request_thread_and_sees_a_stopped_rank():
    with Executor.start(ExecutorConfig(model="seeded:tiny3", num_blocks=16, tokens_per_block=4)) as ex:
        be = Backend(ex, threads=1)
        release = threading.Event()

        async def run() -> None:
            busy = asyncio.ensure_future(be.call(release.wait, 60))  # the only request thread, taken
            await asyncio.sleep(0.1)
            t0 = time.monotonic()
            assert await be.ranks_answer(timeout=10)
            assert time.monotonic() - t0 < 5, "the probe waited for a request thread"
            with stopped([p.pid for p in ex._procs]):
                assert not await be.ranks_answer(timeout=1)
            assert await be.ranks_answer(timeout=10)
            release.set()
            await busy

        try:
            asyncio.run(run())
        finally:
            release.set()
            be.close()
