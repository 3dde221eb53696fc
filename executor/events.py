"""What the leader reports to the parent about requests: one frozen dataclass per event kind.

The leader's Engine makes them (engine.py says when each comes), leader.py adds the block ids of Ctx and
GenAlloc and sends them over the rank's pipe (pipe_messages.py frames them), the Executor handle (runtime.py)
waits on them. Fields go through the strict codec (strict.py); new fields only at the end, with defaults.

    Started(rid, t)                     a context-only prefill was admitted into a step (only when its
                                        ctx_info asked: "notify_start"; t: unix seconds)
    Ctx(rid, first_token, num_tokens, block_ids, lp, loaded, reused, t_end)   a context-only prefill is
                                        done (t_end: unix seconds, when its step's forward and sampling ended)
    GenAlloc(rid, block_ids)            a generation-only request has its blocks (receive its KV into them)
    Done(rid, tokens, reason, error, transfer, loaded, reused, lps, t_decode)    a request ended (stop,
                                        length, aborted); t_decode: unix seconds when a generation-only
                                        request started decoding (its KV and its first token both in)
    Tok(rid, n, tok, lp)                a streaming request's newest token (n = its tokens so far)
    Refused(rid, msg)                   a request could never run (bad input, never fits the pool)
    ReqError(rid, msg)                  a call about a request was not allowed (unknown id, wrong state)
    Released(rid)                       a context-only request's blocks were released

Owns these forms only; never decides when an event happens.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..transceiver.stats import TransferStats
from .sampling import TokenLogprob
from .strict import Wire, wf

__all__ = ["EventKind", "EVENTS", "Started", "Ctx", "GenAlloc", "Done", "Tok", "Refused", "ReqError", "Released"]


class EventKind(str, enum.Enum):
    STARTED = "started"
    CTX = "ctx"
    GEN_ALLOC = "gen_alloc"
    DONE = "done"
    TOK = "tok"
    REFUSED = "refused"
    REQ_ERROR = "req_error"
    RELEASED = "released"


@dataclass(frozen=True, slots=True)
class Ctx(Wire):
    rid: int = wf(int)
    first_token: int = wf(int)
    num_tokens: int = wf(int)
    block_ids: list = wf(list, [])        # set by the leader from rank 0's KV cache manager
    lp: TokenLogprob | None = wf(TokenLogprob, None, none=True)  # the first token's, when asked for
    loaded: int = wf(int, 0)              # prompt tokens the KV connector loaded
    reused: int = wf(int, 0)              # prompt tokens served from the prefix cache
    t_end: float = wf(float, 0.0, compare=False)         # unix seconds: the prefill's step ended (forward + sampling)


@dataclass(frozen=True, slots=True)
class Started(Wire):
    rid: int = wf(int)
    t: float = wf(float, 0.0, compare=False)             # unix seconds: admitted into the step that prefills it


@dataclass(frozen=True, slots=True)
class GenAlloc(Wire):
    rid: int = wf(int)
    block_ids: list = wf(list, [])


@dataclass(frozen=True, slots=True)
class Done(Wire):
    rid: int = wf(int)
    tokens: list = wf(list)
    reason: str = wf(str)                 # "stop", "length" or "aborted"
    error: str = wf(str, "")              # why it was aborted, when known
    transfer: TransferStats | None = wf(TransferStats, None, none=True)  # generation-only
    loaded: int = wf(int, 0)
    reused: int = wf(int, 0)
    lps: tuple = wf(list, (), of=TokenLogprob)  # logprob entries of the tokens sampled HERE
    t_decode: float = wf(float, 0.0, compare=False)      # generation-only: unix seconds when it started decoding


@dataclass(frozen=True, slots=True)
class Tok(Wire):
    rid: int = wf(int)
    n: int = wf(int)
    tok: int = wf(int)
    lp: TokenLogprob | None = wf(TokenLogprob, None, none=True)


@dataclass(frozen=True, slots=True)
class Refused(Wire):
    rid: int = wf(int)
    msg: str = wf(str)


@dataclass(frozen=True, slots=True)
class ReqError(Wire):
    rid: int = wf(int)
    msg: str = wf(str)


@dataclass(frozen=True, slots=True)
class Released(Wire):
    rid: int = wf(int)


E = EventKind
EVENTS = {E.STARTED: Started, E.CTX: Ctx, E.GEN_ALLOC: GenAlloc, E.DONE: Done, E.TOK: Tok, E.REFUSED: Refused,
          E.REQ_ERROR: ReqError, E.RELEASED: Released}
