"""Weight sources and TP/PP sharding.

A weight source gives FULL tensors by Hugging Face Llama name (float32, CPU); `stage_weights` keeps what one
rank needs (its pipeline stage's layers, its TP shard of each matrix) and moves it to the rank's device and
dtype. Seeded weights draw each full tensor from its own generator, seeded by a stable hash of the seed and
the tensor's name, so values never depend on TP, PP, device or thread count. Never unpickles anything.

Names (Hugging Face Llama):
    model.embed_tokens.weight [V, H]        model.norm.weight [H]        lm_head.weight [V, H] (untied)
    model.layers.{i}.input_layernorm.weight     model.layers.{i}.post_attention_layernorm.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight    model.layers.{i}.mlp.{gate,up,down}_proj.weight
"""

from __future__ import annotations

import hashlib
from typing import Protocol

import torch

from ..errors import ExecutorError
from ..formatter.layout import KVLayout
from .config import ModelConfig

__all__ = ["WeightSource", "SeededWeights", "stage_weights", "tensor_shape", "weight_names", "stable_seed"]


class WeightSource(Protocol):
    config: ModelConfig

    def get(self, name: str) -> torch.Tensor:
        """The full tensor `name` (float32, CPU)."""
        ...


def stable_seed(seed: int, name: str) -> int:
    """A 63-bit seed from (seed, name), the same on every machine and Python version."""
    h = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def tensor_shape(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    H, D, I, V = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
    leaf = name.rsplit(".", 2)[-2] if name.startswith("model.layers.") else name
    shapes = {
        "model.embed_tokens.weight": (V, H), "lm_head.weight": (V, H), "model.norm.weight": (H,),
        "input_layernorm": (H,), "post_attention_layernorm": (H,),
        "q_proj": (cfg.num_heads * D, H), "k_proj": (cfg.num_kv_heads * D, H),
        "v_proj": (cfg.num_kv_heads * D, H),
        "o_proj": (H, cfg.num_heads * D), "gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I),
    }
    if leaf not in shapes:
        raise ExecutorError(f"unknown weight name {name!r}")
    return shapes[leaf]


def weight_names(cfg: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_embeddings:
        names.append("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    return names


class SeededWeights:
    """Deterministic random weights for any ModelConfig.

    Args:
        config: the model shape.
        seed: mixes into every tensor's generator seed.
    """

    def __init__(self, config: ModelConfig, seed: int = 0) -> None:
        self.config = config
        self.seed = int(seed)

    def get(self, name: str) -> torch.Tensor:
        shape = tensor_shape(self.config, name)
        g = torch.Generator(device="cpu").manual_seed(stable_seed(self.seed, name))
        x = torch.randn(shape, generator=g, dtype=torch.float32)
        if len(shape) == 1:  # norm weights: around one
            return 1.0 + 0.1 * x
        if name == "model.embed_tokens.weight":
            return x
        return x / float(shape[1]) ** 0.5


def _rows(t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    return t[start:stop]


def stage_weights(src: WeightSource, layout: KVLayout, rank: int, *, device: str | torch.device,
                  dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The weights rank `rank` needs: its stage's layers (global names), TP shards, on device in dtype.

    Column/row splits: q/k/v and gate/up by output rows, o/down by input columns; q by heads in TP order, k/v
    by `layout.head_range(tp_rank)` (replicated when TP exceeds the kv heads); norms, embeddings replicated.
    """
    cfg = src.config
    tp = layout.split.tp
    tp_rank, pp_rank = layout.coords(rank)
    cfg.check_split(layout.split)
    D = cfg.head_dim
    hq = cfg.num_heads // tp
    hr = layout.head_range(tp_rank)
    ic = cfg.intermediate_size // tp
    out: dict[str, torch.Tensor] = {}

    def put(name: str, t: torch.Tensor) -> None:
        want = tensor_shape(cfg, name)
        out[name] = t.to(device=device, dtype=dtype).contiguous()
        if out[name].dim() != len(want):
            raise ExecutorError(f"weight {name}: rank {len(t.shape)}, expected {len(want)}")

    def full(name: str) -> torch.Tensor:
        t = src.get(name)
        if tuple(t.shape) != tensor_shape(cfg, name):
            raise ExecutorError(f"weight {name} has shape {tuple(t.shape)}, the config says "
                                f"{tensor_shape(cfg, name)}")
        return t

    first, last = pp_rank == 0, pp_rank == layout.split.pp - 1
    if first or (last and cfg.tie_embeddings):
        put("model.embed_tokens.weight", full("model.embed_tokens.weight"))
    if last:
        put("model.norm.weight", full("model.norm.weight"))
        if not cfg.tie_embeddings:
            put("lm_head.weight", full("lm_head.weight"))
    for i in layout.stage_layers(pp_rank):
        p = f"model.layers.{i}."
        put(p + "input_layernorm.weight", full(p + "input_layernorm.weight"))
        put(p + "post_attention_layernorm.weight", full(p + "post_attention_layernorm.weight"))
        put(p + "self_attn.q_proj.weight", _rows(full(p + "self_attn.q_proj.weight"), tp_rank * hq * D,
                                                   (tp_rank + 1) * hq * D))
        for kv in ("k", "v"):
            n = p + f"self_attn.{kv}_proj.weight"
            put(n, _rows(full(n), hr.start * D, hr.stop * D))
        put(p + "self_attn.o_proj.weight", full(p + "self_attn.o_proj.weight")[:, tp_rank * hq * D:
                                                                                 (tp_rank + 1) * hq * D])
        for n in ("gate", "up"):
            put(p + f"mlp.{n}_proj.weight", _rows(full(p + f"mlp.{n}_proj.weight"), tp_rank * ic,
                                                  (tp_rank + 1) * ic))
        put(p + "mlp.down_proj.weight", full(p + "mlp.down_proj.weight")[:, tp_rank * ic:(tp_rank + 1) * ic])
    return out
