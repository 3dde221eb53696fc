"""The step plan: what every rank runs in one step, defined once (the leader's Engine builds it, worker.py runs it).

    StepPlan(step, stop, ops, batch, post, free_before, conn)
        ops     run in order before the forward pass (OPS: one dataclass per kind, below)
        batch   BatchRow per sequence of the forward pass
        post    run after it (POST_OPS)
        free_before  the leader's free-block count before the ops (-1: not checked); every rank compares
        conn    the KV connector's section (connector/wire.py owns its form), or None

Op kinds (rid = the request):
    Reuse(rid, prompt, n)          the request starts on the cached blocks of its prompt's first n tokens;
                                   placed before every op that allocates
    Xfer(rid, prompt_len, ctx_info, reused, prompt)  generation-only: blocks for its pulled KV (the hook
                                   hears on_generation_alloc)
    ConnAlloc(rid, prompt_len, prefix)  blocks the KV connector loads a stored prefix into
    Ready(rid)                     its prompt KV is in place (transfer or connector load)
    CtxDone(rid, first_token)      the previous step's context-only prefill finished (hooks hear it)
    Free(rid) / Release(rid)       free its blocks / unpin and free them (a context-only request)
    Write(rid)                     write the KV shard the parent sent (before the forward)
    HookAbort(rid)                 aborted while a transfer may move its KV: every hook's on_abort
Post op kinds: Read(rid) (KV shard to the parent), Drop(rid) (discard a shard sent for a failed write),
    Digest(rid) (KV digest to the parent), Stats() (block counts to the parent).

Wire: msgpack of plain data through the strict codec (strict.py): [PLAN_VERSION, step, stop, ops, batch, post,
free_before, conn], each op [kind, fields...]. Owns the plan's form only; never decides what goes into one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from .. import codec
from ..errors import ExecutorError, ProtocolError
from .connector.wire import ConnSection
from .sampling import SamplingParams, TokenHistory
from .strict import Table, Wire, need, wf

__all__ = ["PLAN_VERSION", "StepPlan", "BatchRow", "OpKind", "OPS", "POST_OPS", "Reuse",
           "Xfer", "ConnAlloc", "Ready", "CtxDone", "Free", "Release", "Write", "HookAbort", "Read", "Drop",
           "Digest", "Stats"]

PLAN_VERSION = 2  # bump when a plan's, an op's or a batch row's fields change (2: typed, list form)


class OpKind(str, enum.Enum):
    REUSE = "reuse"
    XFER = "xfer"
    CONN_ALLOC = "conn_alloc"
    READY = "ready"
    CTX_DONE = "ctx_done"
    FREE = "free"
    RELEASE = "release"
    WRITE = "write"
    HOOK_ABORT = "hook_abort"
    READ = "read"
    DROP = "drop"
    DIGEST = "digest"
    STATS = "stats"


@dataclass(frozen=True, slots=True)
class Reuse(Wire):
    rid: int = wf(int)
    prompt: list = wf(list)
    n: int = wf(int)


@dataclass(frozen=True, slots=True)
class Xfer(Wire):
    rid: int = wf(int)
    prompt_len: int = wf(int)
    ctx_info: dict = wf(dict)
    reused: int = wf(int, 0)         # prompt tokens its blocks already hold (block reuse)
    prompt: list | None = wf(list, None, none=True)  # with block reuse: its prompt (the blocks' hashes)


@dataclass(frozen=True, slots=True)
class ConnAlloc(Wire):
    rid: int = wf(int)
    prompt_len: int = wf(int)
    prefix: list | None = wf(list, None, none=True)  # with block reuse: the loaded prefix's tokens


@dataclass(frozen=True, slots=True)
class CtxDone(Wire):
    rid: int = wf(int)
    first_token: int = wf(int)


@dataclass(frozen=True, slots=True)
class Ready(Wire):
    rid: int = wf(int)


@dataclass(frozen=True, slots=True)
class Free(Wire):
    rid: int = wf(int)


@dataclass(frozen=True, slots=True)
class Release(Wire):
    rid: int = wf(int)


@dataclass(frozen=True, slots=True)
class Write(Wire):
    rid: int = wf(int)


@dataclass(frozen=True, slots=True)
class HookAbort(Wire):
    rid: int = wf(int)


@dataclass(frozen=True, slots=True)
class Read(Wire):
    rid: int = wf(int)


@dataclass(frozen=True, slots=True)
class Drop(Wire):
    rid: int = wf(int)


@dataclass(frozen=True, slots=True)
class Digest(Wire):
    rid: int = wf(int)


@dataclass(frozen=True, slots=True)
class Stats(Wire):
    pass


K = OpKind
OPS = Table("step plan op", {K.REUSE: Reuse, K.XFER: Xfer, K.CONN_ALLOC: ConnAlloc, K.READY: Ready,
                              K.CTX_DONE: CtxDone, K.FREE: Free, K.RELEASE: Release, K.WRITE: Write,
                              K.HOOK_ABORT: HookAbort})
POST_OPS = Table("step plan post op", {K.READ: Read, K.DROP: Drop, K.DIGEST: Digest, K.STATS: Stats})


class _Sampling:
    """BatchRow.sampling's codec: SamplingParams' own, decoded once per distinct wire form (a running request's
    params come again every step; the key is their exact msgpack bytes, so 1, 1.0 and True never share one)."""

    _seen: dict[bytes, SamplingParams] = {}
    LIMIT = 4096

    @classmethod
    def from_wire(cls, v: Any) -> SamplingParams:
        key = codec.pack(v)
        got = cls._seen.get(key)
        if got is None:
            got = SamplingParams.from_wire(v)
            if len(cls._seen) >= cls.LIMIT:
                cls._seen.clear()
            cls._seen[key] = got
        return got


@dataclass(frozen=True, slots=True)
class BatchRow(Wire):
    """One sequence of a step's batch."""

    rid: int = wf(int)
    start: int = wf(int)             # tokens already in its KV (prefix reuse or earlier steps)
    tokens: list = wf(list)          # the tokens this step computes
    sample: bool = wf(bool)          # this row's last position is sampled
    context_only: bool = wf(bool)    # a context-only prefill: its blocks are pinned after this step
    sampling: SamplingParams = wf(_Sampling)
    history: TokenHistory | None = wf(TokenHistory, None, none=True)  # penalties / min_tokens need it


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step for every rank (module docstring)."""

    step: int
    stop: bool = False
    ops: tuple = ()
    batch: tuple[BatchRow, ...] = ()
    post: tuple = ()
    free_before: int = -1
    conn: ConnSection | None = None

    @classmethod
    def empty(cls, step: int, stop: bool = False, **kw: Any) -> "StepPlan":
        """A plan with nothing to run: keeps followers' waits alive, gives hooks their poll, or stops ranks."""
        return cls(step, stop, **kw)

    def to_wire(self) -> list:
        return [PLAN_VERSION, self.step, self.stop, [OPS.encode(o) for o in self.ops],
                [b.to_wire() for b in self.batch], [POST_OPS.encode(o) for o in self.post], self.free_before,
                None if self.conn is None else self.conn.to_wire()]

    def encode(self) -> bytes:
        return codec.pack(self.to_wire())

    @classmethod
    def from_wire(cls, d: Any) -> "StepPlan":
        """Strict: ExecutorError naming the version, the unknown op kind or the bad field."""
        if not isinstance(d, list) or len(d) != 8:
            raise ExecutorError(f"step plan: expected a list of 8 fields, got {d!r:.80}")
        if type(d[0]) is not int or d[0] != PLAN_VERSION:
            raise ExecutorError(f"step plan: version {d[0]!r}, expected {PLAN_VERSION}")
        step = need(d[1], int, "step plan field 'step'")
        ops, batch, post = (need(d[i], list, f"step plan field {n!r}") for i, n in ((3, "ops"), (4, "batch"),
                                                                                 (5, "post")))
        return cls(step, need(d[2], bool, "step plan field 'stop'"), tuple(OPS.decode(o) for o in ops),
                   tuple(BatchRow.from_wire(b) for b in batch), tuple(POST_OPS.decode(o) for o in post),
                   need(d[6], int, "step plan field 'free_before'"), _conn_section(d[7]))


def _conn_section(d: Any) -> ConnSection | None:
    try:
        return None if d is None else ConnSection.from_wire(d)
    except ProtocolError as e:
        raise ExecutorError(f"step plan field 'conn': {e}") from None
