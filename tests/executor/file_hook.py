"""A rank hook for tests: moves a request's blocks between two executors of the same layout through files.

Context role: on_context_done writes this rank's blocks of the request (raw bytes) and the first token to
files, then reports "release". Generation role: on_generation_alloc checks the first token in ctx_info against
the file, reads the context request's blocks into its own, then reports "kv_ready" (or "abort").
It stands in for the transceiver only to exercise the hook contract.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from kvbridge.executor.hooks import RankContext


class FileHook:
    def __init__(self, ctx: RankContext) -> None:
        self.ctx = ctx
        self.dir = ctx.args["dir"]
        self.role = ctx.args["role"]
        self.pending: dict[str, list[int]] = {"kv_ready": [], "release": [], "abort": []}

    def _path(self, rid: int) -> str:
        return os.path.join(self.dir, f"ctx-{rid}-rank{self.ctx.rank}.bin")

    def on_context_done(self, request_id, block_ids, num_tokens, first_token):
        x = self.ctx.pool[torch.tensor(block_ids)].contiguous().cpu()
        x.view(torch.uint8).numpy().tofile(self._path(request_id))
        with open(self._path(request_id) + ".first", "w") as f:
            f.write(str(first_token))
        self.pending["release"].append(request_id)

    def on_generation_alloc(self, request_id, block_ids, prompt_len, ctx_info):
        if ctx_info.get("fail") or \
                ctx_info.get("first_token") != self._first_token_of(int(ctx_info["ctx_rid"])):
            self.pending["abort"].append(request_id)
            return
        pool = self.ctx.pool
        raw = torch.from_numpy(np.fromfile(self._path(int(ctx_info["ctx_rid"])), dtype=np.uint8))
        shape = (len(block_ids), *pool.shape[1:])
        pool[torch.tensor(block_ids)] = raw.view(pool.dtype).reshape(shape).to(pool.device)
        self.pending["kv_ready"].append(request_id)

    def _first_token_of(self, ctx_rid: int) -> int | None:
        """The context hook of the same rank recorded the first token next to the KV."""
        path = self._path(ctx_rid) + ".first"
        return int(open(path).read()) if os.path.exists(path) else None

    def poll(self):
        out, self.pending = self.pending, {"kv_ready": [], "release": [], "abort": []}
        return out

    def close(self):
        pass


def make(ctx: RankContext) -> FileHook:
    return FileHook(ctx)
