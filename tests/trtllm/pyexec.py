"""A PyExecutor-shaped loop over kvbridge.trtllm, and the context process the tests spawn.

`MiniExecutor` calls the compatibility layer in PyExecutor's order: prepare_resources(scheduled batch),
the forward (kvbridge's StageModel of `seeded:tiny3` over the manager's pool), greedy sampling,
update_resources, then the transceiver's calls. One rank, CPU, float32. The pipe between a test and its
context process carries test commands only (our own processes).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
MODEL = "seeded:tiny3"


class MiniExecutor:
    """One rank: a KVCacheManager, a KvCacheTransceiver and the model, driven like PyExecutor drives them."""

    def __init__(self, tokens_per_block: int, max_tokens: int = 512, instance: str = "mini", **xcfg) -> None:
        from kvbridge.executor.model import StageModel
        from kvbridge.executor.sources import load_source
        from kvbridge.executor.weights import stage_weights
        from kvbridge.trtllm import (CacheTransceiverConfig, CacheType, KvCacheConfig, KvCacheTransceiver,
                                     KVCacheManager, Mapping)

        src = load_source(MODEL)
        c = src.config
        self.kv = KVCacheManager(KvCacheConfig(max_tokens=max_tokens), CacheType.SELF, num_layers=c.num_layers,
                                 num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, tokens_per_block=tokens_per_block,
                                 max_seq_len=128, max_batch_size=4, mapping=Mapping(), dtype=torch.float32)
        w = stage_weights(src, self.kv.layout, 0, device="cpu", dtype=torch.float32)
        self.model = StageModel(c, self.kv.layout, 0, w, self.kv.impl, lambda t: None)
        cfg = CacheTransceiverConfig.from_dict({"backend": "UCX", "kv_transfer_timeout_ms": 30000,
                                                "kv_transfer_sender_future_timeout_ms": 30000})
        self.tr = KvCacheTransceiver(self.kv, cfg, instance=instance, peer_timeout_s=30.0, **xcfg)

    def step(self, batch) -> None:
        """prepare_resources -> forward -> sample -> update_resources, for one scheduled batch."""
        from kvbridge.executor.model import StepBatch
        from kvbridge.trtllm import LlmRequestState as S

        self.kv.prepare_resources(batch)
        seqs = [(r.input_tokens, 0, self.kv.get_cache_indices(r), True) for r in batch.context_requests]
        seqs += [(r.get_tokens()[-1:], r.get_num_tokens() - 1, self.kv.get_cache_indices(r), True)
                 for r in batch.generation_requests]
        logits = self.model.forward(StepBatch.build(seqs, self.kv.tokens_per_block, torch.device("cpu")))
        for r, tok in zip(batch.all_requests, logits.argmax(dim=-1).tolist()):
            r.add_new_token(tok)
        for r in batch.context_requests:
            r.state = S.GENERATION_IN_PROGRESS
        self.kv.update_resources(batch)

    def close(self) -> None:
        self.tr.shutdown()


def _context_main(conn) -> None:
    """The context executor: prefill context-only requests and offer their KV (commands from the test)."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    torch.set_num_threads(1)
    from kvbridge.trtllm import LlmRequest, LlmRequestType, ScheduledRequests

    ex = MiniExecutor(tokens_per_block=4, instance="ctx-instance")
    reqs: dict[int, LlmRequest] = {}
    while conn.poll(300):
        cmd, arg = conn.recv()
        try:
            if cmd == "prefill":  # [(rid, prompt)] -> [(rid, state, params dict, first token)]
                batch = [LlmRequest(rid, p, 1, LlmRequestType.REQUEST_TYPE_CONTEXT_ONLY) for rid, p in arg]
                ex.tr.prepare_context_requests(batch)
                ex.step(ScheduledRequests(context_requests=batch))
                out = []
                for r in batch:
                    reqs[r.request_id] = r
                    ex.tr.respond_and_send_async(r)
                    out.append((r.request_id, r.state.name, r.context_phase_params.to_dict(), r.output_tokens[0]))
                conn.send(out)
            elif cmd == "cancel":
                conn.send(ex.tr.cancel_request(reqs[arg]))
            elif cmd == "finish":  # wait for every transfer, free what ended: -> states, errors, free blocks
                ok, bad = ex.tr.check_context_transfer_status(None)
                states = {rid: (reqs[rid].state.name, reqs[rid].error) for rid in ok + bad}
                for rid in ok + bad:
                    ex.kv.free_resources(reqs.pop(rid))
                conn.send((sorted(ok), sorted(bad), states, ex.kv.get_num_free_blocks(),
                           ex.kv.get_max_resource_count()))
            elif cmd == "close":
                ex.close()
                conn.send(True)
                return
        except Exception:  # noqa: BLE001 - the test shows it
            conn.send(("error", traceback.format_exc()))


class ContextProcess:
    """The spawned context executor, driven by the test."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_context_main, args=(child,), daemon=True)
        self.proc.start()

    def ask(self, cmd: str, arg=None, timeout: float = 120.0):
        self.conn.send((cmd, arg))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"context process: no answer to {cmd!r} within {timeout} s")
        out = self.conn.recv()
        if isinstance(out, tuple) and out[:1] == ("error",):
            raise AssertionError(f"context process failed on {cmd!r}:\n{out[1]}")
        return out

    def close(self) -> None:
        try:
            self.ask("close", timeout=30)
        finally:
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
