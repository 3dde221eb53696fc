"""Disaggregated == aggregated: prefill in a context-only executor, KV moved by the transceiver (real ZeroMQ,
real NIXL/UCX between rank processes) into a generation-only executor with a different split, decode.

Tokens alone cannot see misplaced KV, so every request's KV is also checked position by position: the
generation pool's KV in token order equals the context pool's (executor/kv_check.py), and a deliberate block
swap on the generation side (swap_hook.py) shows the check fails while the tokens still match."""

from __future__ import annotations


import pytest

from kvbridge.errors import ExecutorError
from kvbridge.executor.kv_check import check_positional, mismatches
from kvbridge.executor.runtime import Executor, ExecutorConfig
from kvbridge.executor.transceiver_hook import context_endpoints, disagg_params, hooked_executor_config
from kvbridge.transceiver import DisaggParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], list(range(40, 77)), [3, 1, 4, 1, 5, 9, 2, 6]]
# rank_options with an int rank, as YAML or a Python caller gives it: the ranks get their config as msgpack
XCFG = {"agents": ["nixl"], "transfer_timeout_s": 30, "rank_options": {2: {"nixl": {"idle_progress_s": 0.004}}}}


def _exec(tmp_path, role, tag, **kw) -> Executor:
    run_dir = tmp_path / tag
    run_dir.mkdir()
    return Executor.start(hooked_executor_config(role, f"{tag}-instance", run_dir, XCFG, model="seeded:tiny3",
                                                 timeout_s=90, kv_digests=True, **kw))


@pytest.mark.parametrize("ctx_split, gen_split", [
    ({"tp": 2, "tokens_per_block": 4}, {"tp": 1, "pp": 2, "tokens_per_block": 12}),
    ({"tp": 1, "tokens_per_block": 8}, {"tp": 3, "tokens_per_block": 8}),
], ids=["ctx_tp2_to_gen_pp2_blocks4to12", "ctx_tp1_to_gen_tp3"])
def test_disaggregated_decoding_gives_exactly_the_aggregated_tokens(tmp_path, ctx_split, gen_split):
    with Executor.start(ExecutorConfig(model="seeded:tiny3", num_blocks=64, tokens_per_block=8)) as agg:
        want = agg.generate(PROMPTS, max_tokens=10)
    with _exec(tmp_path, "context", "ctx", num_blocks=64, **ctx_split) as ctx, \
            _exec(tmp_path, "generation", "gen", num_blocks=64, **gen_split) as gen:
        endpoints = context_endpoints(str(tmp_path / "ctx"), ctx.cfg.tp * ctx.cfg.pp)
        gen_ids, ctx_ids = [], []
        for prompt in PROMPTS:
            res = ctx.prefill(prompt)
            ctx_ids.append(res.request_id)
            params = disagg_params(ctx, res.request_id, endpoints).to_dict()
            gen_ids.append(gen.submit(prompt, max_tokens=10, mode="generation_only", first_token=res.first_token,
                                      ctx_info={"disagg_params": params}))
        got = [gen.wait(rid, timeout=60) for rid in gen_ids]
        assert [c.tokens for c in got] == want, [(c.finish_reason, c.error) for c in got]
        for prompt, c_id, g_id in zip(PROMPTS, ctx_ids, gen_ids):
            c_dig, g_dig = ctx.kv_digest(c_id), gen.kv_digest(g_id)
            assert c_dig.num_tokens == len(prompt) and len(c_dig.digests) == 4 * 6  # tiny3: 4 layers, 6 kv heads
            check_positional(c_dig, g_dig, f"prompt of {len(prompt)} tokens")
        stats = got[1].transfer.as_json()
        assert stats["bytes"] > 0 and stats["fragments"] > 0 and stats["agents"] == ["nixl"]
        for c_id in ctx_ids:  # released after the reader's confirmation, which may follow the answer
            ctx.wait_released(c_id, 30)
        assert ctx.free_blocks() == [64] * ctx.cfg.tp * ctx.cfg.pp
        assert gen.free_blocks() == [64] * gen.cfg.tp * gen.cfg.pp


def test_a_failed_transfer_aborts_with_its_reason_and_frees_blocks(tmp_path):
    with _exec(tmp_path, "context", "ctx", num_blocks=32, tp=2, tokens_per_block=4) as ctx, \
            _exec(tmp_path, "generation", "gen", num_blocks=32, tokens_per_block=4) as gen:
        endpoints = context_endpoints(str(tmp_path / "ctx"), 2)
        params = DisaggParams(424242, "ctx-instance", endpoints, ctx.layout).to_dict()  # no such request
        rid = gen.submit(PROMPTS[0], max_tokens=4, mode="generation_only", first_token=1,
                         ctx_info={"disagg_params": params})
        c = gen.wait(rid, timeout=60)
        assert c.finish_reason == "aborted"
        assert "RequestNotFound" in c.error and "has no request 424242" in c.error
        assert gen.free_blocks() == [32]


def test_blocks_swapped_after_the_pull_keep_the_tokens_but_fail_the_positional_check(tmp_path):
    prompt = PROMPTS[1]  # 37 tokens: 4 blocks of 12 on the generation side, the first two swapped
    with Executor.start(ExecutorConfig(model="seeded:tiny3", num_blocks=16, tokens_per_block=12)) as agg:
        want = agg.generate([prompt], max_tokens=10)[0]
    gen_cfg = hooked_executor_config("generation", "gen-instance", tmp_path / "gen", XCFG, model="seeded:tiny3",
                                     timeout_s=90, kv_digests=True, num_blocks=16, tokens_per_block=12)
    (tmp_path / "gen").mkdir()
    gen_cfg.rank_hook = "tests.executor.swap_hook:make"
    with _exec(tmp_path, "context", "ctx", num_blocks=32, tp=2, tokens_per_block=4) as ctx, \
            Executor.start(gen_cfg) as gen:
        endpoints = context_endpoints(str(tmp_path / "ctx"), 2)
        res = ctx.prefill(prompt)
        params = disagg_params(ctx, res.request_id, endpoints).to_dict()
        rid = gen.submit(prompt, max_tokens=10, mode="generation_only", first_token=res.first_token,
                         ctx_info={"disagg_params": params})
        c = gen.wait(rid, timeout=60)
        assert c.finish_reason != "aborted", c.error
        assert c.tokens == want  # token equality cannot see the swap ...
        c_dig, g_dig = ctx.kv_digest(res.request_id), gen.kv_digest(rid)
        bad = mismatches(c_dig, g_dig)
        # ... the positional check does: every (layer, kv head) of both K and V differs (tokens 0..23 moved)
        assert len(bad) == 9 and bad[-1] == f"... and {4 * 6 * 2 - 8} more", bad
        with pytest.raises(ExecutorError, match="positional KV check of swapped failed: layer 0 kv head 0 K"):
            check_positional(c_dig, g_dig, "swapped")
        assert gen.free_blocks() == [16]
