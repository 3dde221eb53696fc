"""Token sampling: greedy, or seeded (temperature / top-k / top-p) reproducible per request.

A seeded draw uses a generator seeded by (request seed, position of the token drawn), so the same request
gives the same tokens whatever it was batched with, and a generation-only executor continues exactly where
a context-only one stopped. Works on float32 logits on any device; draws on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .weights import stable_seed

__all__ = ["SamplingParams", "sample"]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 means greedy; top_k 0 and top_p 1.0 mean no cut-off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def to_wire(self) -> list:
        return [float(self.temperature), int(self.top_k), float(self.top_p), int(self.seed)]

    @classmethod
    def from_wire(cls, v: list) -> "SamplingParams":
        return cls(float(v[0]), int(v[1]), float(v[2]), int(v[3]))


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[int]:
    """One token per row of `logits` [S, V] (float32).

    Args:
        logits: the rows to sample from.
        params: one SamplingParams per row.
        positions: the position the drawn token will take (seeds the draw with the request seed).
    """
    out = logits.argmax(dim=-1).tolist()
    for i, (p, pos) in enumerate(zip(params, positions)):
        if not p.temperature > 1e-5:  # 0, tiny (1/T overflows) or NaN: greedy
            continue
        row = logits[i].float().cpu() / p.temperature
        if p.top_k > 0:
            kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sp, idx = torch.sort(probs, descending=True)
            keep = torch.cumsum(sp, 0) - sp < p.top_p
            keep[0] = True  # top_p <= 0 still keeps the most likely token
            probs = torch.zeros_like(probs).scatter(0, idx[keep], sp[keep])
        if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:
            continue  # degenerate logits: greedy rather than a failed draw
        g = torch.Generator(device="cpu").manual_seed(stable_seed(p.seed, f"pos{pos}"))
        out[i] = int(torch.multinomial(probs, 1, generator=g).item())
    return out
