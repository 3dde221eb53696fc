"""One rank's slice of a Llama-family decoder, with paged attention over the rank's KV pool.

Owns the math: RMSNorm, RoPE (rotate-half), GQA attention reading and writing K/V through block tables,
SwiGLU MLP, TP all-reduces after o_proj and down_proj (through the `Comm` it is given), final norm and LM
head on the last pipeline stage. Never decides what to run (the engine does) and never allocates blocks
(the KV cache manager does). Works on CPU (float32) and CUDA (bf16/fp16); norms, RoPE tables and logits
are computed in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..formatter.layout import KVLayout
from ..kvcache.manager import KVCacheManager
from .config import ModelConfig

__all__ = ["StepBatch", "StageModel"]


@dataclass
class StepBatch:
    """The tokens of one step, flattened over its sequences (built the same way on every rank).

    Attributes:
        input_ids: [T] token ids (used by the first stage).
        positions: [T] absolute positions.
        slot_block, slot_offset: [T] block id and offset inside the block where each token's K/V goes.
        seq_spans: per sequence (first row in T, number of new tokens, start position, block ids tensor).
        sample_rows: [S] rows of T whose logits are wanted (the last new token of each sampling sequence).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_block: torch.Tensor
    slot_offset: torch.Tensor
    seq_spans: list[tuple[int, int, int, torch.Tensor]]
    sample_rows: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @classmethod
    def build(cls, seqs: list[tuple[list[int], int, list[int], bool]], tokens_per_block: int,
              device: torch.device) -> "StepBatch":
        """From (new tokens, start position, block ids, wants a sample) per sequence."""
        ids, pos, spans, samples = [], [], [], []
        row = 0
        for toks, start, blocks, sample in seqs:
            n = len(toks)
            ids.extend(toks)
            pos.extend(range(start, start + n))
            spans.append((row, n, start, torch.tensor(blocks, dtype=torch.int64, device=device)))
            row += n
            if sample:
                samples.append(row - 1)
        positions = torch.tensor(pos, dtype=torch.int64)
        block_idx = positions // tokens_per_block
        slot_block = torch.cat([sp[3].cpu()[block_idx[sp[0]:sp[0] + sp[1]]] for sp in spans]) if spans \
            else torch.zeros(0, dtype=torch.int64)
        return cls(torch.tensor(ids, dtype=torch.int64, device=device), positions.to(device),
                   slot_block.to(device), (positions % tokens_per_block).to(device), spans,
                   torch.tensor(samples, dtype=torch.int64, device=device))


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * w.float()).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class StageModel:
    """The layers of one pipeline stage, TP-sharded, over one rank's KV pool.

    Args:
        cfg: the full model's config.
        layout: the executor's KV layout (decides layers per stage and kv heads per rank).
        rank: this rank.
        weights: from `stage_weights` (global names, already sharded, on device, in dtype).
        kv: this rank's KV cache manager (its pool receives the K/V).
        all_reduce: sums a tensor over the TP group in place (identity when TP is 1).
    """

    def __init__(self, cfg: ModelConfig, layout: KVLayout, rank: int, weights: dict[str, torch.Tensor],
                 kv: KVCacheManager, all_reduce) -> None:
        self.cfg, self.layout, self.rank, self.w, self.kv = cfg, layout, rank, weights, kv
        self.all_reduce = all_reduce
        tp_rank, pp_rank = layout.coords(rank)
        self.layers = list(layout.stage_layers(pp_rank))
        self.first = pp_rank == 0
        self.last = pp_rank == layout.split.pp - 1
        self.hq = cfg.num_heads // layout.split.tp
        self.hkv = layout.local_kv_heads
        self.device = kv.pool.device
        self.dtype = next(iter(weights.values())).dtype
        half = cfg.head_dim // 2
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, dtype=torch.float64) / half))
        self.inv_freq = self.inv_freq.to(torch.float32).to(self.device)
        self.kv_connector = None  # a KV connector (connector/rank.py): its hooks run around each layer
        self.layer_done = None  # layer-wise streaming (streaming.py): called with li once li's KV is written

    # --- pieces -------------------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.w["model.embed_tokens.weight"])

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ang = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        ang = torch.cat((ang, ang), dim=-1)[:, None, :]  # [T, 1, D]
        return ang.cos(), ang.sin()

    def _attention(self, li: int, layer: int, x: torch.Tensor, b: StepBatch, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{layer}.self_attn."
        D, T = self.cfg.head_dim, x.shape[0]
        q = F.linear(x, self.w[p + "q_proj.weight"]).view(T, self.hq, D)
        k = F.linear(x, self.w[p + "k_proj.weight"]).view(T, self.hkv, D)
        v = F.linear(x, self.w[p + "v_proj.weight"]).view(T, self.hkv, D)
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        pool = self.kv.pool
        # write this step's K/V into the request blocks, then attend over what the pool holds (so a prefill
        # reads the same rounded values a later decode, or another executor after a transfer, would read)
        pool[b.slot_block, li, 0, :, b.slot_offset] = k.to(pool.dtype)
        pool[b.slot_block, li, 1, :, b.slot_offset] = v.to(pool.dtype)
        out = torch.empty((T, self.hq, D), dtype=x.dtype, device=x.device)
        rep = self.hq // self.hkv
        scale = 1.0 / D ** 0.5
        for row, n, start, blocks in b.seq_spans:
            S = start + n
            nb = -(-S // self.kv.tokens_per_block)
            kv = pool[blocks[:nb], li]  # [nb, 2, Hkv, tpb, D]
            ks = kv[:, 0].permute(1, 0, 2, 3).reshape(self.hkv, -1, D)[:, :S].to(x.dtype)
            vs = kv[:, 1].permute(1, 0, 2, 3).reshape(self.hkv, -1, D)[:, :S].to(x.dtype)
            if rep > 1:
                ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
            qs = q[row:row + n].transpose(0, 1)  # [Hq, n, D]
            mask = None
            if n > 1:
                qpos = torch.arange(start, S, device=x.device)[:, None]
                mask = torch.arange(S, device=x.device)[None, :] <= qpos
            if x.is_cuda:
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
            else:  # small CPU shapes: plain math beats SDPA's threaded kernel by ~20x
                s = torch.matmul(qs.float(), ks.float().transpose(1, 2)) * scale
                if mask is not None:
                    s = s.masked_fill(~mask, float("-inf"))
                o = torch.matmul(torch.softmax(s, dim=-1), vs.float()).to(x.dtype)
            out[row:row + n] = o.transpose(0, 1)
        o = F.linear(out.reshape(T, self.hq * D), self.w[p + "o_proj.weight"])
        self.all_reduce(o)
        return o

    def _mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{layer}.mlp."
        h = F.silu(F.linear(x, self.w[p + "gate_proj.weight"])) * F.linear(x, self.w[p + "up_proj.weight"])
        o = F.linear(h, self.w[p + "down_proj.weight"])
        self.all_reduce(o)
        return o

    # --- the stage -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, b: StepBatch, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Run this stage's layers.

        Args:
            b: the step's tokens.
            hidden: [T, H] from the previous stage (None on the first stage, which embeds input_ids).
        Returns:
            [T, H] hidden states for the next stage, or, on the last stage, float32 logits [S, V] of
            `b.sample_rows`.
        """
        x = self.embed(b.input_ids) if self.first else hidden
        cos, sin = self._rope(b.positions)
        eps = self.cfg.rms_eps
        conn = self.kv_connector
        for li, layer in enumerate(self.layers):
            p = f"model.layers.{layer}."
            if conn is not None:
                conn.wait_for_layer_load(li)
            x = x + self._attention(li, layer, _rms_norm(x, self.w[p + "input_layernorm.weight"], eps), b,
                                    cos,
                                    sin)
            if conn is not None:
                conn.save_kv_layer(li)
            if self.layer_done is not None:
                self.layer_done(li)
            x = x + self._mlp(layer, _rms_norm(x, self.w[p + "post_attention_layernorm.weight"], eps))
        if not self.last:
            return x
        h = _rms_norm(x[b.sample_rows], self.w["model.norm.weight"], eps)
        head = self.w["model.embed_tokens.weight"] if self.cfg.tie_embeddings else self.w["lm_head.weight"]
        return F.linear(h, head).float()
