"""A small random Llama that vLLM can serve with no download: HF config, seeded safetensors, a tokenizer.

Owns writing one model folder per spec, cached by content: the folder's name is a digest of the spec (and
of FORMAT), so a second call with the same spec returns the same folder at once, and two processes writing
it at the same time each write a private temporary folder and rename it into place (the first one wins).
Never downloads anything and imports no vllm or transformers (numpy, safetensors and tokenizers only).

The weights are Gaussian with std 1/sqrt(fan_in) (embeddings std 1), so activations stay O(1) and the
greedy tokens depend on the context: a model that ignored its prompt would hide misplaced KV. The tokenizer
is a byte-level BPE trained on a fixed built-in text up to exactly the model's vocabulary (every id decodes),
with `<pad>` = 0, `<s>` = 1, `</s>` = 2 and a plain chat template, so /v1/completions takes text or token
ids and /v1/chat/completions works.

    python -m kvbridge.integrations.vllm.tiny_model [--dir DIR] [--vocab 512 --layers 4 ...]  # the path
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

__all__ = ["TinyLlamaSpec", "tiny_llama", "default_cache_dir", "FORMAT", "kv_bytes_per_token"]

FORMAT = 1  # bump when the files written change (weights' init, tokenizer training, config keys)
CACHE_ENV = "KVBRIDGE_CACHE_DIR"
SPECIALS = ("<pad>", "<s>", "</s>")
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@dataclass(frozen=True)
class TinyLlamaSpec:
    """The model's shape: hidden = heads x head_dim; fp32 KV/token = 2 x layers x kv_heads x head_dim x 4."""

    vocab: int = 512
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    intermediate: int = 256
    max_positions: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        for k, v in asdict(self).items():
            if type(v) is not int or v < (0 if k == "seed" else 1):
                raise ValueError(f"TinyLlamaSpec.{k}: expected a positive integer, got {v!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"TinyLlamaSpec: heads ({self.heads}) must be a multiple of kv_heads "
                             f"({self.kv_heads})")
        if self.vocab < 256 + len(SPECIALS):
            raise ValueError(f"TinyLlamaSpec.vocab: a byte-level tokenizer needs at least "
                             f"{256 + len(SPECIALS)} ids, got {self.vocab}")

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim

    def digest(self) -> str:
        text = json.dumps({"format": FORMAT, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def kv_bytes_per_token(spec: TinyLlamaSpec = TinyLlamaSpec(), dtype_bytes: int = 4) -> int:
    """Bytes of K and V per token over all layers (what a disaggregated request moves per prompt token)."""
    return 2 * spec.layers * spec.kv_heads * spec.head_dim * dtype_bytes


def default_cache_dir() -> Path:
    """$KVBRIDGE_CACHE_DIR, else ~/.cache/kvbridge (XDG_CACHE_HOME honoured)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvbridge"


def tiny_llama(spec: TinyLlamaSpec = TinyLlamaSpec(), cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder of the model `spec` (written on first use): config.json, model.safetensors, tokenizer files.

    Args:
        spec: the model's shape and seed.
        cache_dir: where model folders live (default: default_cache_dir()).
    Returns:
        The folder, ready for `vllm ... --model FOLDER`.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / f"tiny-llama-{spec.digest()}"
    if (final / "COMPLETE").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    try:
        _write(spec, tmp)
        (tmp / "COMPLETE").write_text(json.dumps({"format": FORMAT, **asdict(spec)}) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp made it 0700; the model is no secret
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        try:
            os.rename(tmp, final)
        except OSError:  # another process renamed its copy first: use that one
            if not (final / "COMPLETE").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _write(spec: TinyLlamaSpec, folder: Path) -> None:
    (folder / "config.json").write_text(json.dumps(_config(spec), indent=1) + "\n")
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "do_sample": False}) + "\n")
    from safetensors.numpy import save_file

    save_file(_weights(spec), str(folder / "model.safetensors"), metadata={"format": "pt"})
    _tokenizer(spec, folder)


def _config(spec: TinyLlamaSpec) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": spec.hidden,
            "intermediate_size": spec.intermediate, "num_hidden_layers": spec.layers,
            "num_attention_heads": spec.heads, "num_key_value_heads": spec.kv_heads,
            "head_dim": spec.head_dim,
            "vocab_size": spec.vocab, "max_position_embeddings": spec.max_positions, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "attention_bias": False,
            "mlp_bias": False}


def _weights(spec: TinyLlamaSpec) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(spec.seed)
    h, kv = spec.hidden, spec.kv_heads * spec.head_dim

    def linear(out_f: int, in_f: int) -> np.ndarray:
        return (rng.standard_normal((out_f, in_f)) / np.sqrt(in_f)).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.standard_normal((spec.vocab, h)).astype(np.float32)}
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = linear(h, h)
        w[p + "self_attn.k_proj.weight"] = linear(kv, h)
        w[p + "self_attn.v_proj.weight"] = linear(kv, h)
        w[p + "self_attn.o_proj.weight"] = linear(h, h)
        w[p + "mlp.gate_proj.weight"] = linear(spec.intermediate, h)
        w[p + "mlp.up_proj.weight"] = linear(spec.intermediate, h)
        w[p + "mlp.down_proj.weight"] = linear(h, spec.intermediate)
        w[p + "input_layernorm.weight"] = np.ones(h, np.float32)
        w[p + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
    w["model.norm.weight"] = np.ones(h, np.float32)
    w["lm_head.weight"] = linear(spec.vocab, h)
    return w


def _corpus() -> list[str]:
    """A fixed text to train the BPE merges on (deterministic; any text would do)."""
    words = ("the of and to in is was that for on with as by at from his her they we you it this which "
             "cache block layer head token prompt prefill decode transfer memory server request model "
             "kvbridge vllm context generation attention tensor parallel pipeline write read haiku sea "
             "river mountain light morning evening quiet number one two three four five six seven").split()
    rng = np.random.default_rng(1234)
    lines = [" ".join(words[j] for j in rng.integers(0, len(words), 24)) for _ in range(400)]
    return lines + ["Write a haiku about the sea.", "The quick brown fox jumps over the lazy dog. 0123456789"]


def _tokenizer(spec: TinyLlamaSpec, folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=1)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    n = tok.get_vocab_size()
    if n < spec.vocab:  # the corpus ran out of merges: pad with never-produced tokens so every id decodes
        tok.add_tokens([f"<unused{i}>" for i in range(spec.vocab - n)])
    if tok.get_vocab_size() != spec.vocab:
        raise RuntimeError(f"tiny tokenizer: {tok.get_vocab_size()} tokens, expected {spec.vocab}")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
         "pad_token": "<pad>", "add_bos_token": False, "model_max_length": spec.max_positions,
         "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}, indent=1) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvbridge.integrations.vllm.tiny_model",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help=f"cache folder (default ${CACHE_ENV} or ~/.cache/kvbridge)")
    for k, v in asdict(TinyLlamaSpec()).items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
    a = ap.parse_args(argv)
    try:
        spec = TinyLlamaSpec(**{k: getattr(a, k) for k in asdict(TinyLlamaSpec())})
    except ValueError as e:
        print(f"tiny_model: {e}", file=sys.stderr)
        return 2
    print(tiny_llama(spec, a.dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
