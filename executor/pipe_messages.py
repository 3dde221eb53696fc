"""The messages on the parent <-> rank pipes, defined once: commands to the leader, replies and events back.

    parent -> rank 0   Add, Join, KvReady, Release, Abort, ReadKv, WriteKv, QueryStats, QueryDigest, Stop
    parent -> rank r   KvShard (+ payload: the rank's share of a request's KV, before a WriteKv)
    rank r -> parent   RankReady (once loaded), KvShard (+ payload, after a ReadKv), RankStats (after a
                       QueryStats), RankDigest (kv_check.py, after a QueryDigest), RankExit, RankError (fatal)
    rank 0 -> parent   the leader's events (events.py: Ctx, GenAlloc, Done, Tok, Refused, ReqError, Released)

A frame is msgpack of [PIPE_VERSION, has_payload, kind, *fields] (strict.py); `encode` / `decode_command` /
`decode_reply` are the only code that reads one; a wrong version, an unknown kind or a bad field raises
ExecutorError naming it. Fatal is the rank's inbox telling its own leader that the parent's pipe failed: it
never travels. Owns the message forms only; pipes.py moves the frames, leader.py and runtime.py act on them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from ..errors import ExecutorError
from .events import EVENTS
from .kv_check import RankDigest
from .sampling import SamplingParams
from .strict import Table, Wire, wf

__all__ = ["PIPE_VERSION", "PipeKind", "COMMANDS", "REPLIES", "encode", "decode_command", "decode_reply",
           "Add", "Join", "KvReady", "Release", "Abort", "ReadKv", "WriteKv", "QueryStats", "QueryDigest", "Stop",
           "Fatal", "KvShard", "RankReady", "RankStats", "RankExit", "RankError"]

PIPE_VERSION = 1  # bump when a frame's layout or a message's fields change (new fields at the end: no bump)


class PipeKind(str, enum.Enum):
    ADD = "add"
    JOIN = "join"
    KV_READY = "kv_ready"
    RELEASE = "release"
    ABORT = "abort"
    READ = "read"
    WRITE = "write"
    STATS = "stats"
    DIGEST = "digest"
    STOP = "stop"
    KV = "kv"
    READY = "ready"
    RANK_STATS = "rank_stats"
    KV_DIGEST = "kv_digest"
    EXIT = "exit"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class Add(Wire):
    """Submit a request (engine.py: Request)."""

    rid: int = wf(int)
    prompt: list = wf(list)
    max_tokens: int = wf(int)
    mode: str = wf(str)
    sampling: SamplingParams = wf(SamplingParams)
    stop_ids: list = wf(list)
    first_token: int | None = wf(int, none=True)
    ctx_info: dict = wf(dict)
    stream: bool = wf(bool, False)


@dataclass(frozen=True, slots=True)
class Join(Wire):
    """The first token of a generation-only request submitted without one (ctx_info "first_token_later")."""

    rid: int = wf(int)
    first_token: int = wf(int)


@dataclass(frozen=True, slots=True)
class KvReady(Wire):
    rid: int = wf(int)


@dataclass(frozen=True, slots=True)
class Release(Wire):
    rid: int = wf(int)


@dataclass(frozen=True, slots=True)
class Abort(Wire):
    rid: int = wf(int)


@dataclass(frozen=True, slots=True)
class ReadKv(Wire):
    rid: int = wf(int)


@dataclass(frozen=True, slots=True)
class WriteKv(Wire):
    rid: int = wf(int)


@dataclass(frozen=True, slots=True)
class QueryStats(Wire):
    pass


@dataclass(frozen=True, slots=True)
class QueryDigest(Wire):
    rid: int = wf(int)


@dataclass(frozen=True, slots=True)
class Stop(Wire):
    why: str = wf(str, "")


@dataclass(frozen=True, slots=True)
class Fatal(Wire):
    msg: str = wf(str)


@dataclass(frozen=True, slots=True)
class KvShard(Wire):
    """One rank's share of a request's KV (the payload: its bytes, [layers, kv_factor, heads, tokens, dim])."""

    rid: int = wf(int)
    shape: list = wf(list)
    dtype: str = wf(str)
    rank: int = wf(int, -1)  # the sending rank (-1: the parent)


@dataclass(frozen=True, slots=True)
class RankReady(Wire):
    rank: int = wf(int)
    config: dict = wf(dict)   # ModelConfig.to_dict()
    layout: dict = wf(dict)   # KVLayout.to_wire()
    pid: int = wf(int)


@dataclass(frozen=True, slots=True)
class RankStats(Wire):
    rank: int = wf(int)
    free: int = wf(int)
    live: list = wf(list)
    cached: int = wf(int)
    reused: int = wf(int)


@dataclass(frozen=True, slots=True)
class RankExit(Wire):
    rank: int = wf(int)


@dataclass(frozen=True, slots=True)
class RankError(Wire):
    rank: int = wf(int)
    msg: str = wf(str)
    tb: str = wf(str, "")


K = PipeKind
COMMANDS = Table("command", {K.ADD: Add, K.JOIN: Join, K.KV_READY: KvReady, K.RELEASE: Release, K.ABORT: Abort,
                             K.READ: ReadKv, K.WRITE: WriteKv, K.STATS: QueryStats, K.DIGEST: QueryDigest,
                             K.STOP: Stop, K.KV: KvShard})
REPLIES = Table("rank reply", {K.READY: RankReady, K.KV: KvShard, K.RANK_STATS: RankStats,
                               K.KV_DIGEST: RankDigest, K.EXIT: RankExit, K.ERROR: RankError, **EVENTS})
_ALL = {**COMMANDS.tag_of, **REPLIES.tag_of}


def encode(msg: Any, has_payload: bool = False) -> list:
    """The frame (plain data, before msgpack) of a command, reply or event."""
    tag = _ALL.get(type(msg))
    if tag is None:
        raise ExecutorError(f"pipe message: {type(msg).__name__} is not a pipe message")
    return [PIPE_VERSION, has_payload, tag, *msg.to_wire()]


def _decode(table: Table, frame: Any) -> tuple[Any, bool]:
    if not isinstance(frame, list) or len(frame) < 3:
        raise ExecutorError(f"executor frame: expected [version, has_payload, kind, ...], got {frame!r:.120}")
    if type(frame[0]) is not int or frame[0] != PIPE_VERSION:
        raise ExecutorError(f"executor frame: version {frame[0]!r}, expected {PIPE_VERSION}")
    if type(frame[1]) is not bool:
        raise ExecutorError(f"executor frame: has_payload is {frame[1]!r:.40}, expected bool")
    return table.decode(frame[2:]), frame[1]


def decode_command(frame: Any) -> tuple[Any, bool]:
    """(the command, whether a payload follows) of a parent -> rank frame."""
    return _decode(COMMANDS, frame)


def decode_reply(frame: Any) -> tuple[Any, bool]:
    """(the reply or event, whether a payload follows) of a rank -> parent frame."""
    return _decode(REPLIES, frame)
