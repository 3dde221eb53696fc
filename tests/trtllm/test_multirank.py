"""KvCacheTransceiver across the ranks of a context executor: two context rank processes (TP2) exchange their
endpoints and agree on completion through the executor's all_gather (relayed by this test, as an MPI or
torch.distributed all-gather would); a generation rank (TP1, another block size) pulls both halves over NIXL and
its WHOLE pool is compared with the image it must hold (position-dependent codes, never zeros)."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
import traceback

import numpy as np
import torch

from kvbridge.formatter.verify import pool_image
from kvbridge.trtllm import (CacheTransceiverConfig, CacheType, KvCacheConfig, KVCacheManager, KvCacheTransceiver,
                             LlmRequest, LlmRequestState as S, LlmRequestType, Mapping, ScheduledRequests)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SHAPE = dict(num_layers=2, num_kv_heads=4, head_dim=16, max_seq_len=64, max_batch_size=4, dtype=torch.bfloat16)
CFG = {"backend": "NIXL", "kv_transfer_timeout_ms": 60000}
LENGTHS = {1: 13, 2: 29}  # request id -> prompt tokens


def _manager(tp: int, rank: int, tpb: int) -> KVCacheManager:
    return KVCacheManager(KvCacheConfig(max_tokens=256), CacheType.SELF, tokens_per_block=tpb,
                          mapping=Mapping(world_size=tp, rank=rank, tp_size=tp), **SHAPE)


def _fill(kv: KVCacheManager, held: list, background: int) -> None:
    img = pool_image(kv.layout, kv.mapping.rank, kv.get_max_resource_count(), held, background)
    kv.pool.view(torch.uint8).reshape(-1).copy_(torch.from_numpy(img))


def _ctx_rank(conn, rank: int) -> None:
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    os.environ.setdefault("UCX_LOG_LEVEL", "error")

    def all_gather(mine: list) -> list[list]:
        conn.send(("gather", mine))
        if not conn.poll(60):
            raise TimeoutError(f"rank {rank}: no all_gather answer within 60 s")
        return conn.recv()

    kv = _manager(2, rank, 4)
    tr = KvCacheTransceiver(kv, CacheTransceiverConfig.from_dict(CFG), instance="ctx-mr", all_gather=all_gather,
                            peer_timeout_s=30.0)
    reqs, held = {}, []
    try:
        for rid, n in LENGTHS.items():  # prefill stand-in: the request's blocks get its codes on every rank
            r = reqs[rid] = LlmRequest(rid, list(range(n)), 1, LlmRequestType.REQUEST_TYPE_CONTEXT_ONLY)
            kv.prepare_resources(ScheduledRequests(context_requests=[r]))
            held.append((kv.get_cache_indices(r), n, rid))
            r.state = S.GENERATION_IN_PROGRESS
        _fill(kv, held, 1 + rank)
        for r in reqs.values():
            tr.respond_and_send_async(r)
        conn.send(("params", {rid: r.context_phase_params.to_dict() for rid, r in reqs.items()}))
        ok, bad = tr.check_context_transfer_status(None)
        states = sorted({r.state.name for r in reqs.values()})
        for r in reqs.values():
            kv.free_resources(r)
        conn.send(("done", (sorted(ok), sorted(bad), states, kv.get_num_free_blocks())))
    except Exception:  # noqa: BLE001 - the test shows it
        conn.send(("error", traceback.format_exc()))
    finally:
        tr.shutdown()


def _relay(conns, until: str, timeout: float = 120.0) -> list:
    """Serve the ranks' all_gathers until every rank sent `until`; returns what each sent with it."""
    out, gathered = [None] * len(conns), [None] * len(conns)
    deadline = time.monotonic() + timeout
    while any(o is None for o in out):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the context ranks did not all reach {until!r} within {timeout} s")
        for i, c in enumerate(conns):
            if out[i] is None and c.poll(0.01):
                kind, val = c.recv()
                if kind == "error":
                    raise AssertionError(f"context rank {i}:\n{val}")
                if kind == "gather":
                    gathered[i] = val
                else:
                    out[i] = val
        if all(g is not None for g in gathered):
            for c in conns:
                c.send(list(gathered))
            gathered = [None] * len(conns)
    return out


def test_two_context_ranks_agree_through_all_gather_and_every_byte_arrives():
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_ctx_rank, args=(child, r), daemon=True) for r, (_, child) in enumerate(pipes)]
    for p in procs:
        p.start()
    conns = [parent for parent, _ in pipes]
    kv = _manager(1, 0, 8)
    _fill(kv, [], 100)
    gen = KvCacheTransceiver(kv, CacheTransceiverConfig.from_dict(CFG), instance="gen-mr", peer_timeout_s=30.0)
    try:
        params, _ = _relay(conns, "params")
        assert len(params[1]["endpoints"]) == 2  # both ranks' endpoints, exchanged through all_gather
        reqs = [LlmRequest(rid, list(range(n)), 4, LlmRequestType.REQUEST_TYPE_GENERATION_ONLY,
                           context_phase_params=params[rid]) for rid, n in LENGTHS.items()]
        kv.prepare_resources(ScheduledRequests(context_requests=reqs))
        for r in reqs:
            gen.request_and_receive_async(r)
        ok, bad = gen.check_gen_transfer_status(None)
        assert (sorted(ok), bad) == ([1, 2], [])
        want = pool_image(kv.layout, 0, kv.get_max_resource_count(),
                          [(kv.get_cache_indices(r), r.prompt_len, r.request_id) for r in reqs], 100)
        assert np.count_nonzero(want != pool_image(kv.layout, 0, kv.get_max_resource_count(), [], 100)) > 0
        got = kv.pool.view(torch.uint8).reshape(-1).numpy()
        assert int(np.count_nonzero(got != want)) == 0  # the whole pool: both halves in place, nothing else
        done = _relay(conns, "done")
        for ok_ids, bad_ids, states, free in done:
            assert (ok_ids, bad_ids, states, free) == ([1, 2], [], ["DISAGG_CONTEXT_COMPLETE"], 64)
    finally:
        gen.shutdown()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
