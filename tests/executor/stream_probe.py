"""Fault injection for layer-wise streaming tests: the transceiver hook plus timestamps and a stalled layer.

Context ranks: after marking their FIRST layer group ready, the forward pass waits (bounded) until the file
`stall_until` exists, so the prefill cannot end before whatever writes that file happened; when the last
local layer is marked, `prefill_end-<rank>` gets time.monotonic(). `stall_until` may name the request as
{rid} (the context executor's request id); `stalled-<rank>-<rid>` is written when the stall begins.
Generation ranks: once the first block of request `rid` holds layer 0's KV (all zeros before the pull on a
fresh pool), `first_read-<rank>-<rid>` gets time.monotonic().
All processes run on one host, so their monotonic clocks compare.
"""

from __future__ import annotations

import os
import threading
import time

from kvbridge.executor.hooks import RankContext
from kvbridge.executor.transceiver_hook import TransceiverHook

STALL_LIMIT_S = 60.0


def write_time(path: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(repr(time.monotonic()))
    os.replace(path + ".tmp", path)


def wait_file(path: str, timeout: float) -> bool:
    """Wait (bounded) for `path` to exist; True if it does."""
    deadline, tick = time.monotonic() + timeout, threading.Event()
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        tick.wait(0.002)
    return True


class StreamProbe(TransceiverHook):
    def __init__(self, ctx: RankContext) -> None:
        super().__init__(ctx)
        self.dir = ctx.args["probe_dir"]
        self.stall_until = ctx.args.get("stall_until")
        self.local = len(ctx.layout.stage_layers(ctx.layout.coords(ctx.rank)[1]))
        self.pool = ctx.kv.pool
        self.first_group: dict[int, int] = {}
        self.watch: tuple[int, int] | None = None  # generation: (request, its first block) until layer 0 came

    def on_layers_ready(self, request_id: int, layers: int) -> None:
        super().on_layers_ready(request_id, layers)
        if layers == self.local:
            write_time(os.path.join(self.dir, f"prefill_end-{self.rank}"))
        elif self.first_group.setdefault(request_id, layers) == layers and self.stall_until:
            write_time(os.path.join(self.dir, f"stalled-{self.rank}-{request_id}"))
            if not wait_file(self.stall_until.format(rid=request_id), STALL_LIMIT_S):
                open(os.path.join(self.dir, f"stall_timed_out-{self.rank}"), "w").close()

    def on_generation_alloc(self, request_id, block_ids, prompt_len, ctx_info) -> None:
        self.watch = (int(request_id), int(block_ids[0]))
        super().on_generation_alloc(request_id, block_ids, prompt_len, ctx_info)

    def poll(self) -> dict[str, list]:
        if self.watch is not None and bool(self.pool[self.watch[1], 0].abs().sum() > 0):
            write_time(os.path.join(self.dir, f"first_read-{self.rank}-{self.watch[0]}"))
            self.watch = None
        return super().poll()


def make(ctx: RankContext) -> StreamProbe:
    return StreamProbe(ctx)
