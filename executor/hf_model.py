"""Hugging Face Llama checkpoints: a directory with config.json and *.safetensors (a user's own model).

Owns reading config.json into a ModelConfig (validated, unknown architectures refused) and serving tensors
from safetensors files (never pickle / torch.load). Also `save_safetensors_dir`, which writes any weight
source in this format (tests use it to round-trip the seeded model).
"""

from __future__ import annotations

import json
import os

import torch

from ..errors import ExecutorError
from .config import ModelConfig
from .weights import WeightSource, weight_names

__all__ = ["SafetensorsWeights", "save_safetensors_dir", "hf_tokenizer"]

_ARCHS = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}


def _config(path: str) -> ModelConfig:
    fn = os.path.join(path, "config.json")
    try:
        with open(fn, encoding="utf-8") as f:
            c = json.load(f)
    except (OSError, ValueError) as e:
        raise ExecutorError(f"{fn}: cannot read the model config ({e})") from None
    if not isinstance(c, dict):
        raise ExecutorError(f"{fn}: expected a JSON object")
    archs = set(c.get("architectures") or ["LlamaForCausalLM"])
    if not archs & _ARCHS:
        raise ExecutorError(f"{fn}: architectures {sorted(archs)}; supported: {sorted(_ARCHS)}")
    if c.get("attention_bias") or c.get("mlp_bias"):
        raise ExecutorError(f"{fn}: attention/MLP biases are not supported by the reference model")
    if c.get("rope_scaling"):
        raise ExecutorError(f"{fn}: rope_scaling {c['rope_scaling']!r} is not supported by the reference "
                            f"model")
    eos = c.get("eos_token_id")
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    try:
        return ModelConfig(
            vocab_size=int(c["vocab_size"]), hidden_size=int(c["hidden_size"]),
            num_layers=int(c["num_hidden_layers"]), num_heads=int(c["num_attention_heads"]),
            num_kv_heads=int(c.get("num_key_value_heads") or c["num_attention_heads"]),
            intermediate_size=int(c["intermediate_size"]),
            head_dim=int(c.get("head_dim") or 0), rope_theta=float(c.get("rope_theta", 10000.0)),
            rms_eps=float(c.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(c.get("tie_word_embeddings",
                                                                                  False)),
            max_position=int(c.get("max_position_embeddings", 4096)),
            bos_token_id=c.get("bos_token_id"), eos_token_ids=tuple(int(e) for e in eos))
    except KeyError as e:
        raise ExecutorError(f"{fn}: missing field {e}") from None


class SafetensorsWeights:
    """A WeightSource over a Hugging Face Llama directory (config.json + one or more *.safetensors)."""

    def __init__(self, path: str) -> None:
        from safetensors import safe_open

        self.path = path
        self.config = _config(path)
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise ExecutorError(f"{path}: no *.safetensors files")
        self._where: dict[str, str] = {}
        for f in files:
            with safe_open(os.path.join(path, f), framework="pt") as h:
                for k in h.keys():
                    self._where[k] = os.path.join(path, f)
        missing = [n for n in weight_names(self.config) if n not in self._where]
        if missing:
            raise ExecutorError(f"{path}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self._where:
            raise ExecutorError(f"{self.path}: no tensor {name!r}")
        with safe_open(self._where[name], framework="pt") as h:
            return h.get_tensor(name).to(torch.float32)


def save_safetensors_dir(src: WeightSource, path: str) -> None:
    """Write `src` as a Hugging Face Llama directory (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    c = src.config
    os.makedirs(path, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size,
           "hidden_size": c.hidden_size, "num_hidden_layers": c.num_layers,
           "num_attention_heads": c.num_heads,
           "num_key_value_heads": c.num_kv_heads, "intermediate_size": c.intermediate_size,
           "head_dim": c.head_dim,
           "rope_theta": c.rope_theta, "rms_norm_eps": c.rms_eps, "tie_word_embeddings": c.tie_embeddings,
           "max_position_embeddings": c.max_position, "bos_token_id": c.bos_token_id,
           "eos_token_id": list(c.eos_token_ids)}
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=1)
    save_file({n: src.get(n).contiguous() for n in weight_names(c)}, os.path.join(path, "model.safetensors"))


def hf_tokenizer(path: str):
    """(tokenizers.Tokenizer, chat template or None) of a Hugging Face directory, or (None, None)."""
    fn = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(fn):
        return None, None
    from tokenizers import Tokenizer

    tmpl = None
    tc = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(tc):
        try:
            with open(tc, encoding="utf-8") as f:
                t = json.load(f).get("chat_template")
            tmpl = t if isinstance(t, str) else None
        except (OSError, ValueError):
            tmpl = None
    return Tokenizer.from_file(fn), tmpl
