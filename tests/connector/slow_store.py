"""Fault injection for the executor tests: a persistent store whose loads are reported late (a slow store)."""

from __future__ import annotations

import os
import time

from kvbridge.executor.connector.persistent import PersistentKvConnectorScheduler, PersistentKvConnectorWorker

__all__ = ["PersistentKvConnectorScheduler", "SlowLoadWorker"]


class SlowLoadWorker(PersistentKvConnectorWorker):
    """Reports each ended load `args["slow_load_s"]` seconds late, or (`args["gate"]`, a path) only once that
    file exists, so a test can act while a request loads: with the gate, for as long as it needs."""

    def __init__(self, ctx):
        super().__init__(ctx)
        self._delay = float(ctx.args.get("slow_load_s", 0))
        self._gate = ctx.args.get("gate")
        self._late: list[tuple[float, int]] = []

    def get_finished(self, finished_gen_req_ids, started_loading_req_ids):
        saved, loaded = super().get_finished(finished_gen_req_ids, started_loading_req_ids)
        now = time.monotonic()
        self._late += [(now + self._delay, rid) for rid in loaded]
        if self._gate is not None and not os.path.exists(self._gate):
            return saved, []
        due = [rid for t, rid in self._late if t <= now]
        self._late = [(t, rid) for t, rid in self._late if t > now]
        return saved, due
