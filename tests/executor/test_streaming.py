"""Layer-wise streaming (ExecutorConfig.stream_layers): a context-only request is published when admitted and
its layers are marked ready as the prefill writes them; the generation side reads them meanwhile.

Real rank processes, real ZeroMQ and NIXL/UCX. The overlap is made deterministic by fault injection
(stream_probe.py): each context rank's forward pass stalls after its first layer group until the generation
side has read layer 0 — so the prefill can only end after the first read if the read really happened while
the prefill ran — and the monotonic timestamps of both (one host) are compared."""

from __future__ import annotations

import os

import pytest

from kvbridge.executor.kv_check import check_positional
from kvbridge.executor.runtime import Executor, ExecutorConfig
from kvbridge.executor.transceiver_hook import context_endpoints, disagg_params, hooked_executor_config

from .stream_probe import wait_file, write_time

PROMPT = list(range(30, 67))  # 37 tokens
XCFG = {"agents": ["nixl"], "transfer_timeout_s": 30, "stream_layers": True, "lease_s": 3.0}
PROBE = "tests.executor.stream_probe:make"


def _exec(tmp_path, role, tag, probe_args: dict, **kw) -> Executor:
    run_dir = tmp_path / tag
    run_dir.mkdir()
    cfg = hooked_executor_config(role, f"{tag}-instance", run_dir, XCFG, model="seeded:tiny3", timeout_s=90,
                                 kv_digests=True, num_blocks=32, **kw)
    cfg.rank_hook = PROBE
    cfg.rank_hook_args.update(probe_dir=str(tmp_path), **probe_args)
    return Executor.start(cfg)


def _times(tmp_path, prefix: str) -> list[float]:
    return [float(open(tmp_path / f).read()) for f in sorted(os.listdir(tmp_path)) if f.startswith(prefix)
            and not f.endswith(".tmp")]


@pytest.mark.parametrize("ctx_split", [{"tp": 2, "tokens_per_block": 4}, {"pp": 2, "tokens_per_block": 8}],
                         ids=["ctx_tp2_to_gen_tp1", "ctx_pp2_to_gen_tp1"])
def test_streamed_prefill_is_read_while_it_runs_and_decodes_the_aggregated_tokens(tmp_path, ctx_split):
    with Executor.start(ExecutorConfig(model="seeded:tiny3", num_blocks=32, tokens_per_block=8)) as agg:
        want = agg.generate([PROMPT], max_tokens=10)[0]
    gen_rid = 7
    with _exec(tmp_path, "context", "ctx", {"stall_until": str(tmp_path / f"first_read-0-{gen_rid}")},
               stream_layers=1, **ctx_split) as ctx, \
            _exec(tmp_path, "generation", "gen", {}, tokens_per_block=12) as gen:
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
        first_read = _times(tmp_path, f"first_read-0-{gen_rid}")
        prefill_end = _times(tmp_path, "prefill_end-")
        assert len(first_read) == 1 and len(prefill_end) == world
        assert first_read[0] < min(prefill_end), (first_read, prefill_end)  # read while the prefill ran
        ctx.wait_released(ctx_rid, timeout=30)
        assert ctx.free_blocks() == [32] * world
        assert gen.free_blocks() == [32]
