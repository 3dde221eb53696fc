"""The stage model's paged attention equals a dense recompute; SmolLM2 (GGUF) loads, tokenizes and answers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvbridge.executor.config import kv_layout_for, parse_seeded_spec
from kvbridge.kvcache.manager import KVCacheManager
from kvbridge.executor.model import StageModel, StepBatch
from kvbridge.executor.weights import SeededWeights, stage_weights
from kvbridge.formatter.layout import ParallelSplit


def _dense_logits(src, ids: list[int]) -> torch.Tensor:
    """Full recompute of every position, no cache: the textbook Llama forward."""
    cfg = src.config
    W = src.get
    D, T = cfg.head_dim, len(ids)
    x = W("model.embed_tokens.weight")[torch.tensor(ids)]
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, D // 2, dtype=torch.float64) / (D // 2))).float()
    ang = torch.arange(T, dtype=torch.float32)[:, None] * inv[None]
    ang = torch.cat([ang, ang], -1)
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]

    def rms(v, w):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + cfg.rms_eps) * w

    def rot(v):
        return torch.cat([-v[..., D // 2:], v[..., :D // 2]], -1)

    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        h = rms(x, W(p + "input_layernorm.weight"))
        q = (h @ W(p + "self_attn.q_proj.weight").T).view(T, cfg.num_heads, D)
        k = (h @ W(p + "self_attn.k_proj.weight").T).view(T, cfg.num_kv_heads, D)
        v = (h @ W(p + "self_attn.v_proj.weight").T).view(T, cfg.num_kv_heads, D)
        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        k, v = k.repeat_interleave(cfg.q_per_kv, 1), v.repeat_interleave(cfg.q_per_kv, 1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           is_causal=True)
        x = x + o.transpose(0, 1).reshape(T, -1) @ W(p + "self_attn.o_proj.weight").T
        h = rms(x, W(p + "post_attention_layernorm.weight"))
        x = x + (F.silu(h @ W(p + "mlp.gate_proj.weight").T) * (h @ W(p + "mlp.up_proj.weight").T)) \
            @ W(p + "mlp.down_proj.weight").T
    head = W("model.embed_tokens.weight") if cfg.tie_embeddings else W("lm_head.weight")
    return rms(x, W("model.norm.weight")) @ head.T


def _stage(src, num_blocks=32, tpb=4):
    layout = kv_layout_for(src.config, ParallelSplit(1, 1), "float32", tpb)
    kv = KVCacheManager(layout, 0, num_blocks)
    w = stage_weights(src, layout, 0, device="cpu", dtype=torch.float32)
    return StageModel(src.config, layout, 0, w, kv, lambda t: None), kv


@pytest.mark.parametrize("spec", ["seeded:tiny", "seeded:tiny-tied", "seeded:tiny-mqa"])
def test_paged_prefill_then_decode_equals_dense_recompute(spec):
    src = SeededWeights(*parse_seeded_spec(spec))
    m, kv = _stage(src)
    toks = [5, 17, 33, 2, 99, 100, 7]
    kv.add_sequence(1, len(toks))
    b = StepBatch.build([(toks, 0, kv.get_batch_cache_indices([1])[0], True)], 4, torch.device("cpu"))
    logits = m.forward(b)
    for _ in range(6):  # crosses two block boundaries
        toks.append(int(logits[0].argmax()))
        kv.prepare_resources([(1, len(toks))])
        b = StepBatch.build([([toks[-1]], len(toks) - 1, kv.get_batch_cache_indices([1])[0], True)], 4,
                            torch.device("cpu"))
        logits = m.forward(b)
        torch.testing.assert_close(logits[0], _dense_logits(src, toks)[-1], rtol=1e-4, atol=1e-4)


def test_seeded_weights_depend_only_on_seed_and_name():
    cfg, _ = parse_seeded_spec("seeded:tiny")
    a, b = SeededWeights(cfg, 0), SeededWeights(cfg, 0)
    n = "model.layers.2.self_attn.k_proj.weight"
    torch.set_num_threads(1)
    one = a.get(n)
    torch.set_num_threads(2)
    assert torch.equal(one, b.get(n))
    assert not torch.equal(one, SeededWeights(cfg, 1).get(n))
    assert not torch.equal(one, a.get("model.layers.1.self_attn.k_proj.weight"))


@pytest.fixture(scope="module")
def smollm2():
    from kvbridge.executor.gguf_model import GGUFWeights, smollm2_path
    from kvbridge.executor.tokenizer import GGUFTokenizer

    src = GGUFWeights(smollm2_path())
    return src, GGUFTokenizer(src.file.meta)


def test_smollm2_config_tokenizer_and_chat_template_come_from_the_gguf(smollm2):
    src, tok = smollm2
    c = src.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == \
        (30, 576, 9, 3, 64, 49152)
    assert c.tie_embeddings and c.eos_token_ids == (2,)
    text = "Hello world 12345, it's   spaced\n<|im_start|>"
    ids = tok.encode(text)
    assert ids[-1] == 1 and ids[3:8] == [tok.encode(str(d))[0] for d in "12345"]  # digits split one by one
    assert tok.decode(ids, skip_special=False) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_smollm2_answers_the_capital_of_france(smollm2):
    src, tok = smollm2
    m, kv = _stage(src, num_blocks=8, tpb=16)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    kv.add_sequence(1, len(ids))
    out, toks = [], list(ids)
    b = StepBatch.build([(toks, 0, kv.get_batch_cache_indices([1])[0], True)], 16, torch.device("cpu"))
    for _ in range(10):
        out.append(int(m.forward(b)[0].argmax()))
        if out[-1] == 2:
            break
        toks.append(out[-1])
        kv.prepare_resources([(1, len(toks))])
        b = StepBatch.build([([toks[-1]], len(toks) - 1, kv.get_batch_cache_indices([1])[0], True)], 16,
                            torch.device("cpu"))
    assert "Paris" in tok.decode(out)
