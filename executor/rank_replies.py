"""The parent's side of the rank pipes: every rank's replies filed in one state, and the bounded waits on it.

Owns one reader thread per rank (each files its rank's messages, pipe_messages.py and events.py, under one
condition variable), the table of what each reply kind does to the state, and the waits the `Executor`
(runtime.py) builds its calls from. Every wait has a deadline; a rank that dies, fails or sends a bad frame
sets `fatal`, and every pending and later wait raises ExecutorError naming it. Never sends a command except
through `_send` (to the leader, rank 0) and never interprets a request beyond its id.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from ..errors import ExecutorError, KVCacheExhausted
from ..kvcache.manager import TORCH_DTYPES
from . import events as E
from . import pipe_messages as pm
from .kv_check import RankDigest

__all__ = ["RankReplies", "raise_refusal"]


@dataclass
class _State:
    events: dict = field(default_factory=dict)       # (event class, rid) -> event (events.py)
    kv: dict = field(default_factory=dict)           # (rid, rank) -> tensor
    partial: dict = field(default_factory=dict)      # rid -> tokens so far of a streaming request
    partial_lp: dict = field(default_factory=dict)   # rid -> TokenLogprob entries so far of one
    stats: dict = field(default_factory=dict)        # rank -> RankStats
    digests: dict = field(default_factory=dict)      # (rid, rank) -> RankDigest
    ready: dict = field(default_factory=dict)        # rank -> RankReady
    fatal: str | None = None


class RankReplies:
    """Rank processes' replies and the waits on them; `Executor` (runtime.py) is the subclass that starts the
    ranks (setting `_procs` and `_pipes`, then one `_read_loop` thread per rank) and holds the API."""

    def __init__(self) -> None:
        self._st = _State()
        self._cv = threading.Condition()
        self._live: set[int] = set()  # ids submitted, not yet ended (done / refused / req_error / released)
        self._closing = False
        self._procs: list = []
        self._pipes: list = []

    # --- sending, reading, waiting -----------------------------------------------------------------------
    def _send(self, msg) -> None:
        self._check()
        try:
            self._pipes[0].send(msg)
        except (OSError, ValueError) as e:
            raise ExecutorError(f"the leader rank is gone ({e})") from None

    def _check(self) -> None:
        if self._st.fatal:
            raise ExecutorError(self._st.fatal)
        if self._closing:
            raise ExecutorError("the executor is closed")

    def _read_loop(self, rank: int) -> None:
        pipes = self._pipes[rank]
        try:
            while True:
                got = pipes.recv(0.5)
                if got is None:
                    if not self._procs[rank].is_alive():
                        raise EOFError
                    continue
                msg, payload = got
                with self._cv:
                    self._dispatch(rank, msg, payload)
                    self._cv.notify_all()
                if isinstance(msg, (pm.RankExit, pm.RankError)):
                    return
        except (EOFError, OSError):
            with self._cv:
                if not self._closing and self._st.fatal is None:
                    self._procs[rank].join(2.0)  # its pipe closes just before it is reaped: get the real code
                    code = self._procs[rank].exitcode
                    how = f", killed by signal {-code}" if code is not None and code < 0 else ""
                    self._st.fatal = f"rank {rank} exited (exit code {code}{how}) without a report"
                self._cv.notify_all()
        except Exception as e:  # noqa: BLE001 - a malformed frame from a rank is fatal for the executor
            with self._cv:
                self._st.fatal = f"rank {rank} sent a bad frame: {e}"
                self._cv.notify_all()

    def _dispatch(self, rank: int, msg, payload: bytes | None) -> None:
        """File one rank's message (pipe_messages.py) in the state the waits look at (under self._cv)."""
        on = _ON_REPLY.get(type(msg))
        if on is not None:
            on(self._st, rank, msg, payload)
        else:  # the leader's other events, waited on by (kind, request id)
            self._st.events[(type(msg), msg.rid)] = msg
            if isinstance(msg, _ENDS_ID):  # the id may be used again
                self._live.discard(msg.rid)

    def _wait_for(self, pred, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                got = pred(self._st)
                if got is not None:
                    return got
                if self._st.fatal:
                    raise ExecutorError(f"while waiting for {what}: {self._st.fatal}")
                if self._closing:  # no reply comes any more: a waiter must not sit out its timeout
                    raise ExecutorError(f"while waiting for {what}: the executor was closed")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ExecutorError(f"timed out after {timeout:.0f}s waiting for {what}")
                self._cv.wait(min(left, 0.5))

    def _wait_event(self, key: tuple[type, int], timeout: float | None, what: str):
        rid = key[1]

        def pred(st: _State):
            for k in (key, (E.Refused, rid), (E.ReqError, rid)):
                if k in st.events:
                    return st.events.pop(k)
            if key[0] is not E.Done and (E.Done, rid) in st.events:  # aborted while waiting
                return st.events.pop((E.Done, rid))
            return None

        ev = self._wait_for(pred, timeout or self.cfg.timeout_s, what)
        raise_refusal(ev)
        if type(ev) is not key[0]:
            raise ExecutorError(f"request {rid} ended ({ev.reason}) while waiting for {what}")
        return ev


def raise_refusal(ev) -> None:
    if isinstance(ev, E.Refused):
        raise KVCacheExhausted(ev.msg) if "blocks" in ev.msg else ExecutorError(ev.msg)
    if isinstance(ev, E.ReqError):
        raise ExecutorError(ev.msg)


def _on_error(st: _State, rank: int, msg: pm.RankError, payload) -> None:
    if st.fatal is None:
        st.fatal = f"rank {rank} failed: {msg.msg}\n{msg.tb}"


def _on_kv(st: _State, rank: int, msg: pm.KvShard, payload) -> None:
    x = torch.frombuffer(bytearray(payload or b""), dtype=torch.uint8).view(TORCH_DTYPES[msg.dtype])
    st.kv[(msg.rid, rank)] = x.reshape(msg.shape)


def _on_tok(st: _State, rank: int, msg: E.Tok, payload) -> None:
    toks = st.partial.setdefault(msg.rid, [])
    if msg.n == len(toks) + 1:
        toks.append(msg.tok)
        if msg.lp is not None:
            st.partial_lp.setdefault(msg.rid, []).append(msg.lp)


_ON_REPLY = {
    pm.RankReady: lambda st, rank, msg, payload: st.ready.__setitem__(rank, msg),
    pm.RankError: _on_error,
    pm.KvShard: _on_kv,
    pm.RankStats: lambda st, rank, msg, payload: st.stats.__setitem__(rank, msg),
    RankDigest: lambda st, rank, msg, payload: st.digests.__setitem__((msg.request_id, rank), msg),
    E.Tok: _on_tok,
    pm.RankExit: lambda st, rank, msg, payload: None,
}
_ENDS_ID = (E.Done, E.Refused, E.ReqError, E.Released)  # after one of these a request id is free again
