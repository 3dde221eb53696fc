"""The context side's per-request state: a published request (Entry) and its state machine, what is
remembered once it finished (Tomb), the result handed to the executor (SendResult), and the Fetches that came
before their request was published (EarlyFetches).

Owns the entry state machine, changed only by `Entry.advance` (table below, rule in fsm.py):

    PUBLISHED --first Fetch accepted--> READING --every expected reader Done--> COMPLETE (FAILED: one failed)
    PUBLISHED | READING | CANCELLING --pickup timeout / lease runs out--> EXPIRED
    PUBLISHED | READING --cancel, no reader active--> CANCELLED
    READING --cancel, readers active--> CANCELLING --the last active reader Done--> CANCELLED
The four terminal states are the statuses a SendResult reports. Pure state, changed only by the Sender's I/O
thread (sender.py, and its off-thread jobs' callbacks on that thread); nothing here touches a socket or the
pool.
"""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable
from enum import Enum

import numpy as np

from . import messages as m
from .fsm import move

__all__ = ["ENTRY_MOVES", "EarlyFetches", "Entry", "EntryState", "SendResult", "StagedSlot", "Tomb", "renew_leases",
           "unknown_answer"]


class EntryState(str, Enum):
    """Where a published request is on this context rank (the last four are terminal)."""

    PUBLISHED = "published"    # pinned, no generation rank has fetched it yet
    READING = "reading"        # at least one reader fetched it
    CANCELLING = "cancelling"  # cancelled while readers were active: pinned until they finish or expire
    COMPLETE = "complete"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLED = "cancelled"

    __str__ = str.__str__
    __format__ = str.__format__

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset({EntryState.COMPLETE, EntryState.FAILED, EntryState.EXPIRED, EntryState.CANCELLED})

ENTRY_MOVES: dict[EntryState, frozenset[EntryState]] = {
    EntryState.PUBLISHED: frozenset({EntryState.READING, EntryState.EXPIRED, EntryState.CANCELLED}),
    EntryState.READING: frozenset({EntryState.COMPLETE, EntryState.FAILED, EntryState.EXPIRED,
                                   EntryState.CANCELLING, EntryState.CANCELLED}),
    EntryState.CANCELLING: frozenset({EntryState.CANCELLED, EntryState.EXPIRED}),
    **{s: frozenset() for s in _TERMINAL},
}


@dataclass
class SendResult:
    """A request that is finished on this context rank; its blocks may be freed once all ranks agree."""

    ctx_request_id: int
    status: str  # "complete" | "failed" | "expired" | "cancelled" (a terminal EntryState's value)
    detail: str = ""
    readers: int = 0


@dataclass
class Entry:
    """One published request on this context rank: its blocks, secret, readers and their progress."""

    rid: int
    blocks: np.ndarray
    num_tokens: int
    layers_ready: int
    deadline: float
    secret: bytes = field(default=b"", repr=False)
    state: EntryState = EntryState.PUBLISHED
    instance: str | None = None
    expected: frozenset[int] = frozenset()
    fetched: dict[int, bytes] = field(default_factory=dict)  # gen rank -> ROUTER identity
    done: dict[int, bool] = field(default_factory=dict)  # gen rank -> ok
    published_at: float = field(default_factory=time.monotonic)
    slots: dict[int, StagedSlot] = field(default_factory=dict)  # gen rank -> its staging slot (staged path)
    read_from: dict[int, int] = field(default_factory=dict)  # gen rank -> first token it reads (prefix reuse)
    read_ahead_ok: bool = False  # published complete under a secret made here: a read-ahead is vouched for

    def advance(self, to: EntryState) -> None:
        """The one place an entry's state changes; IllegalTransition for a move ENTRY_MOVES does not list."""
        self.state = move(f"request {self.rid}", ENTRY_MOVES, self.state, to)

    @property
    def cancel_requested(self) -> bool:
        return self.state is EntryState.CANCELLING

    @property
    def active_readers(self) -> int:
        return len(set(self.fetched) - set(self.done))

    def admit(self, instance: str, gen_rank: int, msg: m.Fetch, rank: int,
              readers: Callable[[], Iterable[int]]) -> tuple[m.ErrorCode, str] | None:
        """Whether context rank `rank` serves this Fetch from generation rank `gen_rank` of `instance`: None, or
        the error to answer (code, text). The first instance admitted claims the request (its expected readers:
        `readers()`, the generation ranks the mapping has read this rank); another instance's Fetch is TAKEN."""
        if self.cancel_requested:
            return m.ErrorCode.CANCELLED, f"request {self.rid} was cancelled"
        if self.instance is None:
            self.instance, self.expected = instance, frozenset(readers())
        elif self.instance != instance:
            return m.ErrorCode.TAKEN, f"request {self.rid} is being pulled by generation instance {self.instance}"
        if gen_rank not in self.expected:
            return m.ErrorCode.MALFORMED, f"generation rank {gen_rank} reads nothing from context rank {rank}"
        if not 0 <= msg.from_token < self.num_tokens:
            return m.ErrorCode.MALFORMED, (f"fetch of request {self.rid} from token {msg.from_token}: outside its "
                                           f"{self.num_tokens} tokens")
        if msg.done and not msg.read_ahead:
            return m.ErrorCode.MALFORMED, (f"fetch of request {self.rid} carries its Done without read-ahead (no "
                                           f"block ids to have read)")
        why = self.read_ahead_refusal(msg.block_ids, msg.staged) if msg.read_ahead else ""
        if why:
            return m.ErrorCode.READ_AHEAD, f"context rank {rank} refuses the read-ahead of request {self.rid}: {why}"
        return None

    def read_ahead_refusal(self, block_ids: np.ndarray, staged: bool) -> str:
        """Why a read-ahead Fetch cannot be vouched for ("" when it can). Its reads started when the reader
        had the secret; they read final KV only if the request was complete from its publish on and the
        secret was made by that publish; and only the published block ids are pinned."""
        if not self.read_ahead_ok:
            return ("it was published before all its layers were final, or under a secret chosen by the "
                    "caller; leave ctx_block_ids out of its DisaggParams")
        if staged:
            return "a read-ahead cannot be staged"
        ids = np.asarray(block_ids, dtype=np.int64)  # (a Fetch without ids carries an empty tuple)
        if ids.shape != self.blocks.shape or ids.tobytes() != self.blocks.tobytes():  # int64 both: equal bytes
            return (f"the {ids.size} block ids in its DisaggParams are not the {self.blocks.size} it was "
                    f"published with")
        return ""

    def readers_waiting(self, staged: bool = True) -> list[bytes]:
        """ROUTER identities of the readers that fetched and have not reported Done (staged=False: only those
        reading direct, whom a LayersReady of the entry's own layers_ready concerns)."""
        return [ident for gen_rank, ident in self.fetched.items() if gen_rank not in self.done and
                (staged or gen_rank not in self.slots)]


@dataclass(eq=False)
class StagedSlot:
    """One reader's staging slot on this context rank: packed layer range by layer range as layers become
    ready (sender_work.py); `packed` counts the local layers packed (what that reader was told is readable)."""

    piece: Any  # formatter.mapping.Piece: what the reader reads from this rank
    addr: int
    nbytes: int
    from_token: int
    packed: int = 0
    busy: bool = False  # a pack into it runs on the worker: only its callback may free it
    told: bool = False  # Blocks went out (the reader may be reading packed ranges of it)


@dataclass(frozen=True)
class Tomb:
    """What is remembered of a finished request: told only to those who show its secret (or read it)."""

    status: EntryState  # terminal
    secret: bytes = field(repr=False)
    readers: frozenset[bytes]


def renew_leases(entries: dict[int, Entry], early: EarlyFetches, ident: bytes, ids: list[int],
                 until: float) -> list[bool]:
    """A reader's heartbeat: extend to `until` the lease of every listed request it fetched; whether each is
    still pinned for it (a Fetch waiting for its request to be published counts as alive too)."""
    alive = []
    for rid in ids:
        e = entries.get(rid)
        ok = e is not None and ident in e.fetched.values()
        if ok:
            e.deadline = max(e.deadline, until)
        else:
            ok = early.waiting(rid, ident)
        alive.append(ok)
    return alive


def unknown_answer(tomb: Tomb | None, secret: bytes, rid: int, rank: int, wait_s: float) -> tuple[m.ErrorCode, str]:
    """The Error for a Fetch or Done of request `rid` that context rank `rank` does not hold: a finished
    request's status is told only to whoever shows its secret; anyone else hears "no request", exactly as for a
    request never published (a Fetch waited `wait_s` for its publish)."""
    status = tomb.status if tomb is not None and hmac.compare_digest(tomb.secret, secret) else None
    if status is EntryState.EXPIRED:
        return m.ErrorCode.LEASE_EXPIRED, f"request {rid}: its lease expired and its blocks were released"
    if status is EntryState.CANCELLED:
        return m.ErrorCode.CANCELLED, f"request {rid} was cancelled on the context side"
    if status is not None:
        return m.ErrorCode.UNKNOWN_REQUEST, f"request {rid} is already finished"
    return m.ErrorCode.UNKNOWN_REQUEST, (f"context rank {rank} has no request {rid} (not published within "
                                         f"{wait_s:g} s of the fetch)")


class EarlyFetches:
    """Fetches that arrived before their request was published (the executor publishes after its step), each
    waiting until its deadline; at most `limit` request ids wait at once. A reader that gives up before the
    publish withdraws its Fetch (`withdraw`: its Done(ok=False) came): it still waits, so that at the publish
    the reader is admitted and its failure counted at once (the request fails there instead of staying pinned
    for a reader that is gone until its lease runs out)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._by_rid: dict[int, list[tuple[float, bytes, m.Fetch]]] = {}
        self._withdrawn: dict[tuple[int, bytes], str] = {}  # (rid, ident) -> the reader's error

    def __bool__(self) -> bool:
        return bool(self._by_rid)

    @property
    def full(self) -> bool:
        return len(self._by_rid) >= self._limit

    def add(self, rid: int, deadline: float, ident: bytes, msg: m.Fetch) -> None:
        self._by_rid.setdefault(rid, []).append((deadline, ident, msg))

    def take(self, rid: int) -> list[tuple[float, bytes, m.Fetch]]:
        """Remove and return the Fetches waiting for `rid` (put back with `add` those that must keep waiting;
        `withdrawn` then says which of them their readers gave up)."""
        return self._by_rid.pop(rid, [])

    def withdraw(self, rid: int, ident: bytes, error: str) -> bool:
        """Note that the reader at `ident` gave up its Fetch waiting for `rid`; False if none of its waits."""
        if not self.waiting(rid, ident):
            return False
        self._withdrawn[(rid, ident)] = error or "the reader gave up before the publish"
        return True

    def withdrawn(self, rid: int, ident: bytes) -> str | None:
        """The error of a withdrawn Fetch (forgotten once asked), None if it was not withdrawn."""
        return self._withdrawn.pop((rid, ident), None)

    def expired(self, now: float) -> list[tuple[int, bytes, m.Fetch]]:
        """Remove and return (rid, ident, fetch) of every Fetch past its deadline."""
        out = []
        for rid in [r for r, lst in self._by_rid.items() if any(d < now for d, _, _ in lst)]:
            keep = []
            for d, ident, msg in self._by_rid.pop(rid):
                if d < now:
                    out.append((rid, ident, msg))
                    self._withdrawn.pop((rid, ident), None)
                else:
                    keep.append((d, ident, msg))
            if keep:
                self._by_rid[rid] = keep
        return out

    def idents(self) -> set[bytes]:
        """ROUTER identities with a Fetch waiting."""
        return {i for lst in self._by_rid.values() for _, i, _ in lst}

    def waiting(self, rid: int, ident: bytes) -> bool:
        return any(i == ident for _, i, _ in self._by_rid.get(rid, ()))
