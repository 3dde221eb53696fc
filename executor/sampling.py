"""Token sampling: logits processing (penalties, logit bias, min_tokens), then greedy or seeded draws.

Owns `SamplingParams` (and its strict, versioned wire form: it crosses the parent -> leader pipe and every
step plan), `TokenHistory` (what a row's penalties look at) and `TokenLogprob` (a sampled token's logprob and
its top alternatives). Never keeps state between steps: the leader's plan carries each row's history, so a
context-only executor and a generation-only one process the same token identically to an aggregated one.

A seeded draw uses a generator seeded by (request seed, position of the token drawn), so the same request
gives the same tokens whatever it was batched with, and a generation-only executor continues exactly where a
context-only one stopped. Works on float32 logits on any device; draws on CPU. Nothing a request holds can
make it raise: tiny temperatures are greedy, a top_p cut always keeps the most likely token, and a row whose
distribution is not finite falls back to greedy.

Processing order (every step, batched over the rows on tensors):
    1. repetition_penalty (vLLM/HF): a logit of a token seen in prompt or output is divided by it when
       positive, multiplied when negative.
    2. frequency_penalty and presence_penalty (OpenAI): minus f * count and p * [count > 0] over the
       generated tokens only.
    3. logit_bias: added to the logits of the ids named.
    4. min_tokens: the row's banned ids (its stop/EOS ids while it has fewer tokens than min_tokens) -> -inf.
    5. temperature, top_k, top_p, then the draw (greedy when temperature < GREEDY_BELOW).
Logprobs are those of the model's raw distribution (log_softmax of the logits before any processing, as
vLLM's default), clamped to LOGPROB_FLOOR so they are always finite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .weights import stable_seed

__all__ = ["SamplingParams", "TokenHistory", "TokenLogprob", "sample", "sample_step", "WIRE_VERSION",
           "MAX_TOP_LOGPROBS", "logprob_width", "pack_logprobs", "unpack_logprobs"]

# Bump when SamplingParams' wire form changes meaning (a field renamed, retyped or reinterpreted); a new
# field with a default keeps the version.
WIRE_VERSION = 2
GREEDY_BELOW = 1e-5       # temperatures below this are greedy (dividing by 1e-40 overflows to inf/nan)
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024     # entries of one request's logit_bias
LOGPROB_FLOOR = -9999.0
_INT64 = (-(1 << 63), (1 << 63) - 1)
_FIELDS = {"v": int, "temperature": float, "top_k": int, "top_p": float, "seed": int,
           "presence_penalty": float, "frequency_penalty": float, "repetition_penalty": float,
           "logit_bias": list, "min_tokens": int, "ignore_eos": bool, "logprobs": int}


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 means greedy; top_k 0 and top_p 1.0 mean no cut-off.

    presence/frequency penalties are in [-2, 2] (0: off); repetition_penalty > 0 (1: off); logit_bias holds
    (token id, bias in [-100, 100]) pairs; min_tokens masks the stop/EOS ids until that many tokens exist;
    ignore_eos: the stop/EOS ids do not end the request; logprobs: -1 for none, else how many top
    alternatives (0..20) come with each sampled token's logprob. Bad values raise ValueError naming the field.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int = -1

    def __post_init__(self) -> None:
        _check(self.temperature, "temperature", 0.0, math.inf)
        _check(self.top_p, "top_p", 0.0, 1.0)
        _check(self.presence_penalty, "presence_penalty", -2.0, 2.0)
        _check(self.frequency_penalty, "frequency_penalty", -2.0, 2.0)
        _check(self.repetition_penalty, "repetition_penalty", 0.0, math.inf)
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty: expected a number > 0, got {self.repetition_penalty!r}")
        _check_int(self.top_k, "top_k", 0, (1 << 31) - 1)
        _check_int(self.seed, "seed", *_INT64)
        _check_int(self.min_tokens, "min_tokens", 0, (1 << 31) - 1)
        _check_int(self.logprobs, "logprobs", -1, MAX_TOP_LOGPROBS)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos: expected a bool, got {self.ignore_eos!r}")
        bias = tuple(self.logit_bias)
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias: {len(bias)} entries, at most {MAX_LOGIT_BIAS}")
        for pair in bias:
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
                raise ValueError(f"logit_bias: expected (token id, bias) pairs, got {pair!r}")
            _check_int(pair[0], "logit_bias token id", 0, (1 << 31) - 1)
            _check(pair[1], "logit_bias value", -100.0, 100.0)
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def needs_history(self, n_generated: int) -> bool:
        """Whether a row with `n_generated` tokens so far needs its TokenHistory in the step plan."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
                or (n_generated < self.min_tokens and not self.ignore_eos))

    def to_wire(self) -> dict:
        return {"v": WIRE_VERSION, "temperature": float(self.temperature), "top_k": int(self.top_k),
                "top_p": float(self.top_p), "seed": int(self.seed),
                "presence_penalty": float(self.presence_penalty),
                "frequency_penalty": float(self.frequency_penalty),
                "repetition_penalty": float(self.repetition_penalty),
                "logit_bias": [[t, b] for t, b in self.logit_bias], "min_tokens": int(self.min_tokens),
                "ignore_eos": bool(self.ignore_eos), "logprobs": int(self.logprobs)}

    @classmethod
    def from_wire(cls, v: object) -> "SamplingParams":
        """Strict: a dict of exactly the known fields with their types (bool is not int); ValueError else."""
        if not isinstance(v, dict):
            raise ValueError(f"sampling params: expected a dict, got {type(v).__name__}")
        if v.get("v") != WIRE_VERSION:
            raise ValueError(f"sampling params: wire version {v.get('v')!r}, expected {WIRE_VERSION}")
        unknown = set(v) - set(_FIELDS)
        if unknown:
            raise ValueError(f"sampling params: unknown fields {sorted(unknown)}")
        for k, t in _FIELDS.items():
            x = v.get(k)
            ok = (isinstance(x, (int, float)) and not isinstance(x, bool)) if t is float else \
                (type(x) is t)
            if not ok:
                raise ValueError(f"sampling params: {k} is {type(x).__name__}, expected {t.__name__}")
        return cls(**{k: (tuple(tuple(p) if isinstance(p, list) else p for p in x) if k == "logit_bias"
                          else float(x) if _FIELDS[k] is float else x)
                      for k, x in v.items() if k != "v"})


@dataclass(frozen=True)
class TokenHistory:
    """What one row's logits processing looks at: the prompt (repetition_penalty), the tokens generated so far
    (all penalties) and the ids banned this step (min_tokens not reached)."""

    prompt: tuple[int, ...] = ()
    output: tuple[int, ...] = ()
    banned: tuple[int, ...] = ()

    def to_wire(self) -> list:
        return [list(self.prompt), list(self.output), list(self.banned)]

    @classmethod
    def from_wire(cls, v: object) -> "TokenHistory | None":
        if v is None:
            return None
        if not (isinstance(v, list) and len(v) == 3 and all(isinstance(x, list) for x in v)
                and all(type(t) is int and t >= 0 for x in v for t in x)):
            raise ValueError("token history: expected three lists of token ids")
        return cls(tuple(v[0]), tuple(v[1]), tuple(v[2]))


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's logprob and the `top` most likely (token, logprob) pairs, most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def to_wire(self) -> list:
        return [float(self.logprob), [[int(t), float(lp)] for t, lp in self.top]]

    @classmethod
    def from_wire(cls, v: object) -> "TokenLogprob":
        """Strict (the entry may come from a peer): [logprob, [[id, logprob], ...]], at most 20 pairs."""
        if not (isinstance(v, list) and len(v) == 2 and _finite(v[0]) and isinstance(v[1], list)
                and len(v[1]) <= MAX_TOP_LOGPROBS):
            raise ValueError("token logprob: expected [logprob, [[token id, logprob], ...]]")
        top = []
        for p in v[1]:
            if not (isinstance(p, list) and len(p) == 2 and type(p[0]) is int and p[0] >= 0
                    and _finite(p[1])):
                raise ValueError(f"token logprob: bad top entry {p!r:.80}")
            top.append((p[0], float(p[1])))
        return cls(float(v[0]), tuple(top))


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
           history: list[TokenHistory | None] | None = None) -> list[int]:
    """One token per row of `logits` [S, V] (float32); see sample_step."""
    return sample_step(logits, params, positions, history)[0]


def sample_step(logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
                history: list[TokenHistory | None] | None = None
                ) -> tuple[list[int], list[TokenLogprob | None]]:
    """One token per row of `logits` [S, V], and its logprob entry where the row asked for logprobs.

    Args:
        logits: the rows to sample from.
        params: one SamplingParams per row.
        positions: the position the drawn token will take (seeds the draw with the request seed).
        history: one TokenHistory (or None: nothing to penalise or ban) per row.
    """
    raw = logits.float()
    x = process_logits(raw, params, history or [None] * len(params))
    out = x.argmax(dim=-1).tolist()
    for i, (p, pos) in enumerate(zip(params, positions)):
        if not p.greedy:
            out[i] = _draw(x[i], p, pos, out[i])
    return out, _logprobs(raw, params, out)


def process_logits(logits: torch.Tensor, params: list[SamplingParams],
                   history: list[TokenHistory | None]) -> torch.Tensor:
    """Steps 1-4 of the module docstring, on every row at once (a copy; `logits` is left alone)."""
    rows = [i for i, h in enumerate(history) if h is not None]
    if not rows and not any(p.logit_bias for p in params):
        return logits
    S, V = logits.shape
    dev = logits.device
    x = logits.clone()
    if rows:
        counts = torch.zeros(S, V, dtype=x.dtype, device=dev)
        seen = torch.zeros(S, V, dtype=torch.bool, device=dev)
        r_out, t_out = _flat(rows, [history[i].output for i in rows], dev)
        counts.index_put_((r_out, t_out), torch.ones_like(r_out, dtype=x.dtype), accumulate=True)
        r_p, t_p = _flat(rows, [history[i].prompt for i in rows], dev)
        seen[r_p, t_p] = True
        seen |= counts > 0
        rep = torch.tensor([p.repetition_penalty for p in params], dtype=x.dtype, device=dev)[:, None]
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=x.dtype, device=dev)[:, None]
        pres = torch.tensor([p.presence_penalty for p in params], dtype=x.dtype, device=dev)[:, None]
        x = x - freq * counts - pres * (counts > 0).to(x.dtype)
    bias_rows = [i for i, p in enumerate(params) if p.logit_bias]
    if bias_rows:
        r, t = _flat(bias_rows, [[tok for tok, _ in params[i].logit_bias] for i in bias_rows], dev)
        b = torch.tensor([v for i in bias_rows for _, v in params[i].logit_bias], dtype=x.dtype, device=dev)
        x.index_put_((r, t), b, accumulate=True)
    if rows:
        r, t = _flat(rows, [history[i].banned for i in rows], dev)
        x[r, t] = float("-inf")
    return x


def logprob_width(params: list[SamplingParams]) -> int:
    """Columns of top alternatives a step's packed logprobs hold (0: no row asked; at least 1 otherwise)."""
    asked = [p.logprobs for p in params if p.logprobs >= 0]
    return max(1, min(max(asked), MAX_TOP_LOGPROBS)) if asked else 0


def pack_logprobs(entries: list[TokenLogprob | None], k: int) -> torch.Tensor:
    """A step's logprob entries as one int64 tensor (to go where the sampled tokens go): [S, 1 + 2k] float64
    rows (logprob, k top ids, k top logprobs; token ids are exact below 2**53), bit-cast and flattened."""
    buf = torch.zeros(len(entries), 1 + 2 * k, dtype=torch.float64)
    for i, e in enumerate(entries):
        if e is not None:
            buf[i, 0] = e.logprob
            for j, (t, v) in enumerate(e.top):
                buf[i, 1 + j], buf[i, 1 + k + j] = t, v
    return buf.view(torch.int64).reshape(-1)


def unpack_logprobs(flat: torch.Tensor, params: list[SamplingParams], k: int,
                    vocab_size: int) -> list[TokenLogprob | None]:
    """pack_logprobs undone, with each row's own number of alternatives (None where a row did not ask)."""
    buf = flat.contiguous().view(torch.float64).reshape(len(params), 1 + 2 * k)
    out: list[TokenLogprob | None] = []
    for i, p in enumerate(params):
        n = min(p.logprobs, vocab_size)
        top = tuple((int(buf[i, 1 + j]), float(buf[i, 1 + k + j])) for j in range(max(n, 0)))
        out.append(TokenLogprob(float(buf[i, 0]), top) if p.logprobs >= 0 else None)
    return out


def _draw(row: torch.Tensor, p: SamplingParams, pos: int, greedy_token: int) -> int:
    row = row.float().cpu() / p.temperature
    if p.top_k > 0:
        kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sp, idx = torch.sort(probs, descending=True)
        keep = torch.cumsum(sp, 0) - sp < p.top_p
        keep[0] = True  # top_p = 0 (or tiny) keeps the most likely token, never nothing
        probs = torch.zeros_like(probs).scatter(0, idx[keep], sp[keep])
    if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0:
        return greedy_token
    g = torch.Generator(device="cpu").manual_seed(stable_seed(p.seed, f"pos{pos}"))
    return int(torch.multinomial(probs, 1, generator=g).item())


def _logprobs(raw: torch.Tensor, params: list[SamplingParams],
              chosen: list[int]) -> list[TokenLogprob | None]:
    want = [i for i, p in enumerate(params) if p.logprobs >= 0]
    out: list[TokenLogprob | None] = [None] * len(params)
    if not want:
        return out
    lp = torch.log_softmax(raw[want], dim=-1).clamp_min(LOGPROB_FLOOR).cpu()
    k = min(max(params[i].logprobs for i in want), lp.shape[1])
    top_v, top_i = torch.topk(lp, k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    for j, i in enumerate(want):
        n = min(params[i].logprobs, k)
        out[i] = TokenLogprob(float(lp[j, chosen[i]]),
                              tuple(zip(top_i[j, :n].tolist(), top_v[j, :n].tolist())))
    return out


def _flat(rows: list[int], ids: list, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) tensors for every id of every row."""
    r = [i for i, xs in zip(rows, ids) for _ in xs]
    t = [int(tok) for xs in ids for tok in xs]
    return (torch.tensor(r, dtype=torch.long, device=dev), torch.tensor(t, dtype=torch.long, device=dev))


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check(v: object, name: str, lo: float, hi: float) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or not lo <= v <= hi:
        raise ValueError(f"{name}: expected a number in [{lo}, {hi}], got {v!r}")


def _check_int(v: object, name: str, lo: int, hi: int) -> None:
    if type(v) is not int or not lo <= v <= hi:
        raise ValueError(f"{name}: expected an integer in [{lo}, {hi}], got {v!r}")
