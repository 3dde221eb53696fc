"""The GPU path: NCCL between ranks, pools and weights on CUDA, bf16 and float32."""

from __future__ import annotations

import pytest
import torch

from kvbridge.executor.runtime import Executor, ExecutorConfig

PROMPTS = [[5, 17, 33, 2, 99, 100, 7], list(range(200, 219))]


def _cfg(**kw):
    base = dict(model="seeded:tiny", device="cuda", num_blocks=64, tokens_per_block=4, timeout_s=120)
    base.update(kw)
    return ExecutorConfig(**base)


@pytest.mark.cuda
def test_cuda_bf16_context_then_generation_equals_aggregated():
    with Executor.start(_cfg()) as ex:
        assert ex.layout.shape.dtype == "bfloat16"
        want = ex.generate(PROMPTS[1:], max_tokens=12)[0]
        res = ex.prefill(PROMPTS[1])
        kv = ex.read_kv(res.request_id)
        assert kv.dtype == torch.bfloat16 and res.first_token == want[0]
        ex.release(res.request_id)
        g = ex.add_generation(PROMPTS[1], res.first_token, max_tokens=12)
        ex.write_kv(g.request_id, kv)
        ex.kv_ready(g.request_id)
        assert ex.wait(g.request_id).tokens == want
        assert ex.free_blocks() == [64]


@pytest.mark.cuda
@pytest.mark.multigpu
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_cuda_float32_tp_and_pp_match_a_single_gpu(tp, pp):
    with Executor.start(_cfg(dtype="float32")) as ex:
        ref = ex.generate(PROMPTS, max_tokens=10)
        ref_kv = ex.read_kv(ex.prefill(PROMPTS[1]).request_id)
    with Executor.start(_cfg(dtype="float32", tp=tp, pp=pp)) as ex:
        assert ex.generate(PROMPTS, max_tokens=10) == ref
        kv = ex.read_kv(ex.prefill(PROMPTS[1]).request_id)
    torch.testing.assert_close(kv, ref_kv, rtol=1e-3, atol=1e-3)


@pytest.mark.cuda
@pytest.mark.multigpu
def test_cuda_bf16_tp2_context_feeds_a_tp1_generation_executor():
    with Executor.start(_cfg(tp=2)) as ctx, Executor.start(_cfg()) as gen:
        res = ctx.prefill(PROMPTS[1])
        kv = ctx.read_kv(res.request_id)
        ctx.release(res.request_id)
        g = gen.add_generation(PROMPTS[1], res.first_token, max_tokens=12)
        gen.write_kv(g.request_id, kv)
        assert torch.equal(gen.read_kv(g.request_id), kv)
        gen.kv_ready(g.request_id)
        out = gen.wait(g.request_id).tokens
        assert len(out) == 12 and out[0] == res.first_token
        assert ctx.free_blocks() == [64, 64] and gen.free_blocks() == [64]


@pytest.mark.cuda
@pytest.mark.multigpu
def test_cuda_hooks_move_tp2_kv_between_executors(tmp_path):
    def hooked(role):
        return _cfg(tp=2, rank_hook="tests.executor.file_hook:make", rank_hook_args={"dir": str(tmp_path),
                                                                                     "role": role})
    with Executor.start(_cfg(tp=2)) as agg:
        want = agg.generate(PROMPTS[1:], max_tokens=10)[0]
    with Executor.start(hooked("ctx")) as ctx, Executor.start(hooked("gen")) as gen:
        res = ctx.prefill(PROMPTS[1])
        ctx.wait_released(res.request_id, 60)
        rid = gen.submit(PROMPTS[1], max_tokens=10, mode="generation_only", first_token=res.first_token,
                         ctx_info={"ctx_rid": res.request_id, "first_token": res.first_token})
        assert gen.wait(rid).tokens == want
        assert ctx.free_blocks() == [64, 64] and gen.free_blocks() == [64, 64]
