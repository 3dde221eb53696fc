"""One request in the leader's table (engine.py): what it asks for, where it stands, and whether it may run.

Owns the `Request` record, its batch row and sampling history, and `refusal`: the checks a new request must
pass before the engine queues it (each failing one answers a message naming what was wrong). Never touches
the pool, the plan or the events: the engine does, from what this says.

States (`Request.state`), in the order a request moves through them:

    waiting -> (loading -> loaded ->) prefill -> running -> finished              aggregated
    waiting -> (loading -> loaded ->) prefill -> ctx_done -> finished (released)  context_only
    waiting -> awaiting_kv (-> awaiting_token) -> running -> finished             generation_only
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..transceiver.stats import TransferStats
from .plan import BatchRow
from .sampling import SamplingParams, TokenHistory

__all__ = ["MODES", "Request", "refusal"]

MODES = ("aggregated", "context_only", "generation_only")


@dataclass
class Request:
    request_id: int
    prompt: list[int]
    max_tokens: int
    mode: str = "aggregated"
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: tuple[int, ...] = ()
    first_token: int | None = None         # generation-only: the context side's first token
    ctx_info: dict = field(default_factory=dict)
    state: str = "waiting"  # waiting, (loading, loaded,) prefill, running, awaiting_kv(, awaiting_token), ctx_done, finished
    output: list[int] = field(default_factory=list)
    num_cached: int = 0
    reserved: int = 0                       # blocks reserved to completion
    finish_reason: str | None = None
    transfer: TransferStats | None = None   # generation-only: the transfer's stats from the rank hooks
    stream: bool = False                    # report each new token (Tok events) before Done
    loaded: int = 0                         # prompt tokens loaded by the KV connector (not computed)
    reused: int = 0                         # prompt tokens served from the local prefix cache (block reuse)
    logprobs: list = field(default_factory=list)  # TokenLogprob of each token sampled HERE (if asked)
    decode_at: float = 0.0                  # generation-only: unix seconds when it started decoding

    def sample_history(self) -> TokenHistory | None:
        """The step plan's TokenHistory for this request's next token, or None when it needs none."""
        sp, n = self.sampling, len(self.output)
        if not sp.needs_history(n):
            return None
        banned = self.stop_ids if n < sp.min_tokens and not sp.ignore_eos else ()
        prompt = self.prompt if sp.repetition_penalty != 1 else ()
        counted = sp.presence_penalty or sp.frequency_penalty or sp.repetition_penalty != 1
        out = self.output if counted else ()
        return TokenHistory(tuple(prompt), tuple(out), tuple(banned))

    def row(self, start: int, tokens: list) -> BatchRow:
        """This request's batch row computing `tokens` from position `start`, its last position sampled."""
        return BatchRow(self.request_id, start, tokens, True, self.mode == "context_only", self.sampling,
                        self.sample_history())


def refusal(req: Request, vocab_size: int | None, max_position: int) -> str | None:
    """Why a new request can never run on this model (a message naming what was wrong), or None.

    Args:
        req: the request as submitted.
        vocab_size: the model's vocabulary size (None: token ids are not checked).
        max_position: the longest sequence the model supports.
    """
    if req.mode not in MODES:
        return f"mode {req.mode!r} is not one of {MODES}"
    if not req.prompt or req.max_tokens < 1:
        return "a request needs a non-empty prompt and max_tokens >= 1"
    if req.mode == "generation_only" and req.first_token is None and \
            not req.ctx_info.get("first_token_later"):
        return "a generation-only request needs the context side's first token"
    toks = list(req.prompt) + ([req.first_token] if req.first_token is not None else [])
    bias_ids = [t for t, _ in req.sampling.logit_bias]
    if vocab_size is not None and any(t >= vocab_size for t in bias_ids + list(req.stop_ids)):
        bad = next(t for t in bias_ids + list(req.stop_ids) if t >= vocab_size)
        return f"logit_bias/stop token id {bad} is outside the model's vocabulary 0..{vocab_size - 1}"
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in toks):
        bad = next(t for t in toks if not 0 <= t < vocab_size)
        return f"token id {bad} is outside the model's vocabulary 0..{vocab_size - 1}"
    total = len(req.prompt) + (req.max_tokens if req.mode != "context_only" else 1)
    if total > max_position:
        return f"prompt + max_tokens = {total} exceeds the model's {max_position}"
    return None
