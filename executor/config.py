"""Model shapes: the Llama-family config, seeded presets, and `seeded:<preset>[,key=value...]` specs.

Owns shape arithmetic and validation of a model against a TP/PP split, and the KV layout an executor of
that model uses. Pure values: never loads weights.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..errors import ExecutorError
from ..formatter.layout import KVLayout, KVShape, ParallelSplit

__all__ = ["ModelConfig", "PRESETS", "parse_seeded_spec", "kv_layout_for"]


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder: RMSNorm, RoPE (rotate-half), GQA attention, SwiGLU MLP."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    head_dim: int = 0              # 0: hidden_size // num_heads
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    tie_embeddings: bool = True
    max_position: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                  "intermediate_size"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ExecutorError(f"model config: {f} must be a positive integer, got {v!r}")
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ExecutorError(f"model config: hidden_size {self.hidden_size} is not a multiple of "
                                    f"num_heads {self.num_heads}; give head_dim")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim % 2:
            raise ExecutorError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ExecutorError(f"model config: num_heads {self.num_heads} is not a multiple of num_kv_heads "
                                f"{self.num_kv_heads}")
        object.__setattr__(self, "eos_token_ids", tuple(int(x) for x in self.eos_token_ids))

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def check_split(self, split: ParallelSplit) -> None:
        """Raise ExecutorError if this model cannot run with `split` (heads, MLP or layers don't divide)."""
        tp = split.tp
        if self.num_heads % tp:
            raise ExecutorError(f"tp={tp} does not divide the model's {self.num_heads} attention heads")
        if self.intermediate_size % tp:
            raise ExecutorError(f"tp={tp} does not divide the MLP width {self.intermediate_size}")
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            raise ExecutorError(f"tp={tp} cannot shard {self.num_kv_heads} kv heads (it must divide them or "
                                f"be a "
                                f"multiple of them)")
        split.stage_sizes(self.num_layers)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ExecutorError(f"model config: unknown keys {sorted(unknown)}")
        d = dict(d)
        if "eos_token_ids" in d:
            d["eos_token_ids"] = tuple(d["eos_token_ids"])
        return cls(**d)


# Presets for tests and demos. Each is chosen for the TP sizes it admits (untied heads keep a random model's
# greedy tokens varied; a tied random model mostly repeats its input token):
#   tiny     8 heads / 4 kv heads        TP 1, 2, 4 (kv heads sharded); TP 8 (replicated)
#   tiny3    12 heads / 6 kv heads       TP 1, 2, 3, 6
#   tiny-tied 4 heads / 2 kv heads, tied embeddings (the SmolLM2 arrangement)
#   tiny-mqa 4 heads / 1 kv head         TP 1, 2, 4 (the one kv head replicated on every rank)
#   small    a larger GQA model for benchmarks (16 layers, hidden 512, 8 heads / 2 kv heads)
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=256, hidden_size=128, num_layers=4, num_heads=8, num_kv_heads=4,
                 intermediate_size=256,
                 tie_embeddings=False),
    "tiny3": dict(vocab_size=256, hidden_size=192, num_layers=4, num_heads=12, num_kv_heads=6,
                  intermediate_size=384, tie_embeddings=False),
    "tiny-tied": dict(vocab_size=256, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=256),
    "tiny-mqa": dict(vocab_size=256, hidden_size=128, num_layers=3, num_heads=4, num_kv_heads=1,
                     intermediate_size=256, tie_embeddings=False),
    "small": dict(vocab_size=4096, hidden_size=512, num_layers=16, num_heads=8, num_kv_heads=2,
                  intermediate_size=1408),
}
_INT_KEYS = {"vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
             "head_dim", "max_position"}
_ALIASES = {"layers": "num_layers", "hidden": "hidden_size", "heads": "num_heads", "kv_heads": "num_kv_heads",
            "vocab": "vocab_size", "ffn": "intermediate_size", "intermediate": "intermediate_size",
            "theta": "rope_theta", "tied": "tie_embeddings"}


def parse_seeded_spec(spec: str) -> tuple[ModelConfig, int]:
    """`seeded:<preset>[,key=value...][,seed=N]` -> (config, seed).

    Keys are ModelConfig fields or the aliases layers, hidden, heads, kv_heads, vocab, ffn, head_dim, theta,
    tied (0/1), e.g. `seeded:tiny,layers=6,kv_heads=2,seed=3`.
    """
    body = spec.split(":", 1)[1] if spec.startswith("seeded:") else spec
    parts = [p for p in body.split(",") if p]
    if not parts or parts[0] not in PRESETS:
        raise ExecutorError(f"unknown seeded preset in {spec!r}; presets: {sorted(PRESETS)}")
    d = dict(PRESETS[parts[0]])
    seed = 0
    for p in parts[1:]:
        k, eq, v = p.partition("=")
        if not eq:
            raise ExecutorError(f"seeded spec {spec!r}: {p!r} is not key=value")
        k = _ALIASES.get(k, k)
        try:
            if k == "seed":
                seed = int(v)
            elif k in _INT_KEYS:
                d[k] = int(v)
            elif k in ("rope_theta", "rms_eps"):
                d[k] = float(v)
            elif k == "tie_embeddings":
                d[k] = v not in ("0", "false", "no")
            else:
                raise ExecutorError(f"seeded spec {spec!r}: unknown key {k!r}")
        except ValueError:
            raise ExecutorError(f"seeded spec {spec!r}: bad value for {k!r}: {v!r}") from None
    return ModelConfig(**d), seed


def kv_layout_for(cfg: ModelConfig, split: ParallelSplit, dtype: str, tokens_per_block: int) -> KVLayout:
    """The block_major KV layout an executor of `cfg` sharded by `split` uses."""
    cfg.check_split(split)
    return KVLayout(KVShape(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, tokens_per_block), split,
                    "block_major")
