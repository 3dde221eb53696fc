"""Fault injection for the positional KV check: the transceiver hook, but a generation rank swaps the contents
of a request's first two blocks once its KV has arrived (just before reporting "kv_ready").

It stands for a block-order bug between the executor and the transceiver: every byte arrived, in the wrong
place. Decoding cannot see it (tokens match); the positional check must.
"""

from __future__ import annotations

import torch

from kvbridge.executor.hooks import RankContext
from kvbridge.executor.transceiver_hook import TransceiverHook


class SwapHook(TransceiverHook):
    def __init__(self, ctx: RankContext) -> None:
        super().__init__(ctx)
        self.pool = ctx.kv.pool
        self.blocks: dict[int, list[int]] = {}

    def on_generation_alloc(self, request_id, block_ids, prompt_len, ctx_info) -> None:
        self.blocks[request_id] = list(block_ids)
        super().on_generation_alloc(request_id, block_ids, prompt_len, ctx_info)

    def poll(self) -> dict[str, list]:
        out = super().poll()
        for rid in out["kv_ready"]:
            ids = self.blocks.pop(rid, [])
            if len(ids) >= 2:
                a, b = ids[0], ids[1]
                self.pool[[a, b]] = self.pool[[b, a]].clone()
                if self.pool.is_cuda:
                    torch.cuda.synchronize(self.pool.device)
        return out


def make(ctx: RankContext) -> SwapHook:
    return SwapHook(ctx)
