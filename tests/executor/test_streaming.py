"""Layer-wise streaming (ExecutorConfig.stream_layers): a context-only request is published when admitted and
its layers are marked ready as the prefill writes them; the generation side reads them meanwhile.

Real rank processes, real ZeroMQ and NIXL/UCX. The overlap is made deterministic by fault injection
(stream_probe.py): each context rank's forward pass stalls after its first layer group until the generation
side has read layer 0 — so the prefill can only end after the first read if the read really happened while
the prefill ran — and the monotonic timestamps of both (one host) are compared."""

from __future__ import annotations

import os
import time

import pytest
import torch

from kvbridge.executor.kv_check import check_positional
from kvbridge.executor.runtime import Executor, ExecutorConfig
from kvbridge.executor.transceiver_hook import context_endpoints, disagg_params, hooked_executor_config

from .stream_probe import wait_file, write_time

PROMPT = list(range(30, 67))  # 37 tokens
LONGER = [9, 8, 7, 6, 5, 4, 3]
XCFG = {"agents": ["nixl"], "transfer_timeout_s": 30, "stream_layers": True, "lease_s": 3.0}
HOST = {**XCFG, "staging_arena_bytes": 4 << 20, "staging_memory": "host"}  # staged through host memory, streamed
PROBE = "tests.executor.stream_probe:make"


def _exec(tmp_path, role, tag, probe_args: dict, xcfg: dict = XCFG, **kw) -> Executor:
    run_dir = tmp_path / tag
    run_dir.mkdir()
    cfg = hooked_executor_config(role, f"{tag}-instance", run_dir, xcfg, model="seeded:tiny3", timeout_s=90,
                                 kv_digests=True, num_blocks=32, **kw)
    cfg.rank_hook = PROBE
    cfg.rank_hook_args.update(probe_dir=str(tmp_path), **probe_args)
    return Executor.start(cfg)


def _times(tmp_path, prefix: str) -> list[float]:
    return [float(open(tmp_path / f).read()) for f in sorted(os.listdir(tmp_path)) if f.startswith(prefix)
            and not f.endswith(".tmp")]


@pytest.mark.parametrize("ctx_split", [{"tp": 2, "tokens_per_block": 4}, {"pp": 2, "tokens_per_block": 8}],
                         ids=["ctx_tp2_to_gen_tp1", "ctx_pp2_to_gen_tp1"])
@pytest.mark.parametrize("xcfg", [XCFG, HOST], ids=["direct", "host_staged"])
def test_streamed_prefill_is_read_while_it_runs_and_decodes_the_aggregated_tokens(tmp_path, ctx_split, xcfg):
    with Executor.start(ExecutorConfig(model="seeded:tiny3", num_blocks=32, tokens_per_block=8)) as agg:
        want = agg.generate([PROMPT], max_tokens=10)[0]
    gen_rid = 7
    with _exec(tmp_path, "context", "ctx", {"stall_until": str(tmp_path / f"first_read-0-{gen_rid}")}, xcfg,
               stream_layers=1, **ctx_split) as ctx, \
            _exec(tmp_path, "generation", "gen", {}, xcfg, tokens_per_block=12) as gen:
        world = ctx.cfg.tp * ctx.cfg.pp
        endpoints = context_endpoints(str(tmp_path / "ctx"), world)
        ctx_rid = ctx.submit(PROMPT, max_tokens=1, mode="context_only")
        params = disagg_params(ctx, ctx_rid, endpoints).to_dict()
        # the generation request goes out before the prefill ends (its first token is the aggregated one)
        gen.submit(PROMPT, max_tokens=10, mode="generation_only", first_token=want[0],
                   ctx_info={"disagg_params": params}, request_id=gen_rid)
        res = ctx.wait_context(ctx_rid, timeout=60)
        got = gen.wait(gen_rid, timeout=60)
        assert res.first_token == want[0]
        assert got.finish_reason != "aborted", got.error
        assert got.tokens == want
        check_positional(ctx.kv_digest(ctx_rid), gen.kv_digest(gen_rid), "streamed prompt")
        assert not [f for f in os.listdir(tmp_path) if f.startswith("stall_timed_out")]
        if xcfg is HOST:  # staged: one read per context rank per packed layer range (direct: hundreds)
            assert world <= got.transfer.as_json()["fragments"] <= world * 4 // ctx.cfg.pp
        first_read = _times(tmp_path, f"first_read-0-{gen_rid}")
        prefill_end = _times(tmp_path, "prefill_end-")
        assert len(first_read) == 1 and len(prefill_end) == world
        assert first_read[0] < min(prefill_end), (first_read, prefill_end)  # read while the prefill ran
        ctx.wait_released(ctx_rid, timeout=30)
        assert ctx.free_blocks() == [32] * world
        assert gen.free_blocks() == [32]


def _pools_full(ex: Executor, n: int, timeout: float) -> list[int]:
    """Free blocks per rank, asked again (each answer is a round trip through the step loop) until every pool
    is full or `timeout` passed."""
    deadline = time.monotonic() + timeout
    while True:
        free = ex.free_blocks()
        if all(f == n for f in free) or time.monotonic() > deadline:
            return free


def test_aborts_mid_stream_free_every_block_once_and_the_service_goes_on(tmp_path):
    with Executor.start(ExecutorConfig(model="seeded:tiny3", num_blocks=32, tokens_per_block=8)) as agg:
        want, want_longer = agg.generate([PROMPT, PROMPT + LONGER], max_tokens=6)
    go = str(tmp_path / "go-{rid}")
    with _exec(tmp_path, "context", "ctx", {"stall_until": go}, stream_layers=1, tp=2, tokens_per_block=4,
               enable_block_reuse=True) as ctx, \
            _exec(tmp_path, "generation", "gen", {}, tokens_per_block=12) as gen:
        endpoints = context_endpoints(str(tmp_path / "ctx"), 2)

        def start(gen_rid: int, prompt=PROMPT, first=want[0]) -> int:
            ctx_rid = ctx.submit(prompt, max_tokens=1, mode="context_only")
            gen.submit(prompt, max_tokens=6, mode="generation_only", first_token=first, request_id=gen_rid,
                       ctx_info={"disagg_params": disagg_params(ctx, ctx_rid, endpoints).to_dict()})
            return ctx_rid

        # 1. the generation side gives up mid-stream: layer 0 arrived, the prefill is stalled after it
        ctx_rid = start(1)
        assert wait_file(str(tmp_path / "first_read-0-1"), 60)
        gen.abort(1)
        c = gen.wait(1, timeout=60)
        assert c.finish_reason == "aborted"
        write_time(go.format(rid=ctx_rid))
        assert ctx.wait_context(ctx_rid, timeout=60).first_token == want[0]
        ctx.wait_released(ctx_rid, timeout=30)  # the reader's Done (or its lease running out) releases it
        assert _pools_full(gen, 32, 30) == [32] and _pools_full(ctx, 32, 30) == [32, 32]

        # 2. the context side aborts while its prefill is stalled mid-stream: the abort takes effect when the
        # prefill step ends; the pull either finished first (tokens exact) or fails with the cancel as reason
        ctx_rid = start(2)
        assert wait_file(str(tmp_path / f"stalled-0-{ctx_rid}"), 60)
        ctx.abort(ctx_rid)
        write_time(go.format(rid=ctx_rid))
        c = gen.wait(2, timeout=60)
        assert c.tokens == want or (c.finish_reason == "aborted" and "cancel" in c.error), c
        assert _pools_full(ctx, 32, 30) == [32, 32] and _pools_full(gen, 32, 30) == [32]

        # 3. the next streamed request goes through, byte-exact
        ctx_rid = start(3)
        write_time(go.format(rid=ctx_rid))
        c = gen.wait(3, timeout=60)
        assert c.tokens == want, c
        check_positional(ctx.kv_digest(ctx_rid), gen.kv_digest(3), "after the aborts")
        ctx.wait_released(ctx_rid, timeout=30)
        assert _pools_full(ctx, 32, 30) == [32, 32] and _pools_full(gen, 32, 30) == [32]

        # 4. on a cached prefix: only the new tokens are computed, every layer is marked once ALL its tokens
        # (the cached blocks' and the new ones') are written, and the generation side reads it all exactly
        ctx_rid = start(4, PROMPT + LONGER, want_longer[0])
        write_time(go.format(rid=ctx_rid))
        res = ctx.wait_context(ctx_rid, timeout=60)
        c = gen.wait(4, timeout=60)
        assert res.reused_tokens >= 32 and c.tokens == want_longer, (res, c)
        check_positional(ctx.kv_digest(ctx_rid), gen.kv_digest(4), "streamed on a cached prefix")
        ctx.wait_released(ctx_rid, timeout=30)
        assert _pools_full(ctx, 32, 30) == [32, 32] and _pools_full(gen, 32, 30) == [32]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA events mark the layers)")
def test_cuda_streamed_prefill_marks_layers_by_events_and_decodes_the_aggregated_tokens(tmp_path):
    dev = dict(device="cuda", dtype="bfloat16")
    with Executor.start(ExecutorConfig(model="seeded:tiny3", num_blocks=32, tokens_per_block=8,
                                       **dev)) as agg:
        want = agg.generate([PROMPT], max_tokens=10)[0]
    gen_rid = 5
    with _exec(tmp_path, "context", "ctx", {"stall_until": str(tmp_path / f"first_read-0-{gen_rid}")},
               stream_layers=1, tokens_per_block=4, **dev) as ctx, \
            _exec(tmp_path, "generation", "gen", {}, tokens_per_block=12, **dev) as gen:
        endpoints = context_endpoints(str(tmp_path / "ctx"), 1)
        ctx_rid = ctx.submit(PROMPT, max_tokens=1, mode="context_only")
        gen.submit(PROMPT, max_tokens=10, mode="generation_only", first_token=want[0], request_id=gen_rid,
                   ctx_info={"disagg_params": disagg_params(ctx, ctx_rid, endpoints).to_dict()})
        assert ctx.wait_context(ctx_rid, timeout=60).first_token == want[0]
        got = gen.wait(gen_rid, timeout=60)
        assert got.tokens == want, got
        check_positional(ctx.kv_digest(ctx_rid), gen.kv_digest(gen_rid), "streamed on CUDA")
        assert not [f for f in os.listdir(tmp_path) if f.startswith("stall_timed_out")]
        assert _times(tmp_path, f"first_read-0-{gen_rid}")[0] < _times(tmp_path, "prefill_end-")[0]
        ctx.wait_released(ctx_rid, timeout=30)
        assert ctx.free_blocks() == [32] and gen.free_blocks() == [32]
