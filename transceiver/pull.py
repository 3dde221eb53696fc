"""One generation-side pull: the state of a request being read from its context ranks (one leg per rank).

Owns two state machines, each changed only by its `advance` (tables below, rule in fsm.py):

    Pull:  HANDSHAKE --every leg fetched--> READ --reads settled--> CONFIRM --every DoneAck--> DONE
           HANDSHAKE | READ | CONFIRM --fail()--> DRAIN --reads settled (or quarantine over)--> DONE
    Leg:   NEW --Fetch sent--> FETCH_SENT --Blocks--> FETCHED --Done sent--> DONE_SENT --DoneAck--> ACKED
               (FETCH_SENT --"no session"--> NEW once: the Fetch is sent again after a new handshake)

Pure state and planning; the receiver's I/O thread drives it (receiver.py) and owns the sockets. A pull is
terminal once it reports a ReceiveResult; before that, failure always passes through DRAIN: reads in flight
are cancelled and waited for (bounded), so no transfer can still write into blocks the executor then reuses.
Never sends, never frees local blocks.
"""

from __future__ import annotations

import logging
import threading
import time
from enum import Enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..agents import DescriptorGrid, DescriptorList, MemoryKind, TransferHandle, XferState
from ..formatter.mapping import Piece
from ..formatter.planner import Fragments, RankPool, plan_grid, plan_piece
from ..formatter.scratch import PlanScratch
from ..formatter.staging import layer_range
from . import messages as m
from .fsm import move

log = logging.getLogger("kvbridge.transceiver.receiver")

__all__ = ["Leg", "LegState", "Pull", "PullState", "ReceiveResult"]

_local = threading.local()
# The receiver looks at reads in flight without pausing from _NEAR_S before a read's earliest possible end (the
# pause overshoots 50-80 us on the GPU hosts) until _LATE_S after it, then with the pause again (`near_end`).
_NEAR_S, _LATE_S = 250e-6, 2e-3


def _scratch() -> PlanScratch:
    """The calling thread's plan arrays, for a Pull made without a `scratch` (a Receiver gives all its pulls its
    one PlanScratch: they are planned and released by whichever thread holds its turn lock)."""
    s = getattr(_local, "scratch", None)
    if s is None:
        s = _local.scratch = PlanScratch()
    return s


class PullState(str, Enum):
    """Where one pull is; the receiver's step for each state moves it on (receiver.py, its `_steps` table)."""

    HANDSHAKE = "handshake"  # sessions with every context rank, a Fetch to each, reads posted as ids arrive
    READ = "read"            # every leg fetched: post what becomes readable, wait for the reads
    CONFIRM = "confirm"      # reads settled (unpacked/hashed): Done sent, waiting for every DoneAck
    DRAIN = "drain"          # failed: cancelled reads settle (or are quarantined) before the report
    DONE = "done"            # terminal: reported once

    __str__ = str.__str__
    __format__ = str.__format__


PULL_MOVES: dict[PullState, frozenset[PullState]] = {
    PullState.HANDSHAKE: frozenset({PullState.READ, PullState.DRAIN}),
    PullState.READ: frozenset({PullState.CONFIRM, PullState.DRAIN}),
    PullState.CONFIRM: frozenset({PullState.DONE, PullState.DRAIN}),
    PullState.DRAIN: frozenset({PullState.DONE}),
    PullState.DONE: frozenset(),
}


class LegState(str, Enum):
    """Where the conversation with one context rank about one pull is."""

    NEW = "new"                # no Fetch sent yet (or sent again after the context rank lost our session)
    FETCH_SENT = "fetch_sent"  # Fetch sent, waiting for Blocks
    FETCHED = "fetched"        # Blocks arrived: its block ids are known, reads may be posted
    DONE_SENT = "done_sent"    # Done (ok or failed) sent, waiting for DoneAck
    ACKED = "acked"            # DoneAck arrived

    __str__ = str.__str__
    __format__ = str.__format__


LEG_MOVES: dict[LegState, frozenset[LegState]] = {
    LegState.NEW: frozenset({LegState.FETCH_SENT}),
    LegState.FETCH_SENT: frozenset({LegState.FETCHED, LegState.NEW, LegState.DONE_SENT}),  # DONE_SENT: withdrawn
    LegState.FETCHED: frozenset({LegState.DONE_SENT}),
    LegState.DONE_SENT: frozenset({LegState.ACKED}),
    LegState.ACKED: frozenset(),
}


@dataclass
class ReceiveResult:
    """The outcome of one pull on this generation rank."""

    request_id: int
    ok: bool
    error: str = ""
    error_type: str = ""  # name of the KvBridgeError subclass that describes the failure
    nbytes: int = 0
    fragments: int = 0
    agents: tuple[str, ...] = ()
    timings_ms: dict[str, float] = field(default_factory=dict)


@dataclass
class Leg:
    """What this generation rank reads from one context rank for one request."""

    ctx_rank: int
    endpoint: str
    piece: Piece
    state: LegState = LegState.NEW
    ctx_blocks: np.ndarray | None = None
    layers_ready: int = 0  # local layers of the context rank that are readable
    read_upto: int = 0  # global layer id up to which reads were posted
    handles: list[TransferHandle] = field(default_factory=list)
    retried_session: bool = False  # the one re-Fetch after "no session" is spent
    remote: RankPool | None = None
    agent_kind: str = ""
    peer_name: str = ""
    slot: int | None = None  # staged path: this rank's arena slot for the piece
    remote_slot: int = -1  # staged path: the context rank's packed slot (-1: read direct)
    slot_bytes: int = 0
    slot_mem: tuple = (MemoryKind.DRAM, 0)  # staged path: where this rank's arena lives (kind, device)
    remote_slot_mem: tuple = (MemoryKind.DRAM, 0)  # ...and where the context rank's arena lives
    ranges: list[range] = field(default_factory=list)  # staged path: the global layers each of `handles` reads
    unpacks: list[Any] = field(default_factory=list)  # staged path: Futures unpacking ranges[i] (worker thread)
    read_ahead: bool = False  # the block ids came from DisaggParams; the context rank sends no Blocks
    refused: bool = False  # the context rank answered this leg's Fetch with an Error: nothing of ours is kept there
    plans: list[np.ndarray] = field(default_factory=list)  # plan arrays its reads use: reused once settled

    def advance(self, to: LegState) -> None:
        """The one place a leg's state changes; IllegalTransition for a move LEG_MOVES does not list."""
        self.state = move(f"leg of context rank {self.ctx_rank}", LEG_MOVES, self.state, to)

    def read_ahead_from(self, ctx_blocks: np.ndarray, ctx_layout) -> None:
        """Read-ahead (FETCH_SENT -> FETCHED without a Blocks answer): every layer of the context rank is final
        and its block ids are those of the request's DisaggParams; the context rank vouches for both when it
        takes the Fetch, or refuses it (an Error fails the pull, its reads drained first)."""
        self.ctx_blocks, self.layers_ready, self.read_ahead = ctx_blocks, ctx_layout.local_layers(self.ctx_rank), True
        self.advance(LegState.FETCHED)

    @property
    def fetched(self) -> bool:
        """Blocks arrived (the leg got at least as far as FETCHED)."""
        return self.state in (LegState.FETCHED, LegState.DONE_SENT, LegState.ACKED)

    @property
    def done_sent(self) -> bool:
        return self.state in (LegState.DONE_SENT, LegState.ACKED)

    @property
    def all_posted(self) -> bool:
        return self.read_upto >= self.piece.layers.stop

    def take_blocks(self, msg: m.Blocks, welcome: m.Welcome, arena) -> str:
        """Keep what a Blocks answer says (block ids, layers ready, the packed slot if staged); the error
        (empty if none) when its staged slot lies outside the context rank's arena or is not the piece's size.
        A context rank that went direct (its arena was full) gets our slot back into `arena`."""
        self.ctx_blocks, self.layers_ready = msg.block_ids, msg.layers_ready
        if msg.staging_addr >= 0:
            if (self.slot is None or msg.staging_bytes != self.slot_bytes or msg.staging_addr < welcome.staging_base
                    or msg.staging_addr + msg.staging_bytes > welcome.staging_base + welcome.staging_bytes):
                return (f"context rank {self.ctx_rank} staged {msg.staging_bytes} bytes at {msg.staging_addr:#x}, "
                        f"outside its arena or not the piece's size")
            kind = welcome.staging_kind or welcome.pool_kind
            if kind not in ("DRAM", "VRAM"):
                return f"context rank {self.ctx_rank}: staging arena kind {kind!r} is not DRAM or VRAM"
            self.remote_slot = msg.staging_addr
            self.remote_slot_mem = (MemoryKind(kind), welcome.pool_device if kind == "VRAM" else 0)
        elif self.slot is not None:
            arena.free(self.slot)
            self.slot, self.slot_bytes = None, 0
        return ""

    def pending(self) -> bool:
        return any(h.state() is XferState.PENDING for h in self.handles)

    def failed(self) -> str | None:
        for h in self.handles:
            if h.state() is XferState.FAILED:
                return h.error or "transfer failed"
        return None


@dataclass
class Pull:
    """One request being pulled into this rank's `blocks`: its legs, deadline, first error and timings."""

    request_id: int
    ctx_request_id: int
    ctx_instance: str
    blocks: np.ndarray
    num_tokens: int
    deadline: float
    legs: dict[int, Leg]
    submitted: float = field(default_factory=time.monotonic)
    state: PullState = PullState.HANDSHAKE
    error: str = ""
    error_type: str = ""
    nbytes: int = 0
    fragments: int = 0
    drain_deadline: float = 0.0
    quarantined: bool = False
    marks: dict[str, float] = field(default_factory=dict)
    verifying: Any = None  # Future of {ctx_rank: digests}: unpacking staged legs, then hashing (verify mode)
    staged: bool = False
    from_token: int = 0  # prefix reuse: the local blocks already hold tokens [0, from_token); read the rest
    secret: bytes = field(default=b"", repr=False)  # the context request's secret, sent in every Fetch
    ctx_blocks: np.ndarray | None = None  # read-ahead: the context block ids from DisaggParams
    scratch: PlanScratch | None = field(default=None, repr=False)  # plan arrays (None: the thread's own)
    withdraw: bool = False  # Receiver.withdraw: its Fetches go out, then it fails (Done(ok=False)); no reads

    def advance(self, to: PullState) -> None:
        """The one place a pull's state changes; IllegalTransition for a move PULL_MOVES does not list."""
        self.state = move(f"pull of request {self.request_id}", PULL_MOVES, self.state, to)

    @property
    def terminal(self) -> bool:
        """Draining or done: failing it again changes nothing."""
        return self.state in (PullState.DRAIN, PullState.DONE)

    def mark(self, what: str) -> None:
        self.marks.setdefault(what, time.monotonic())

    def fail(self, error_type: str, error: str, drain_s: float) -> None:
        """Enter draining (once): cancel reads in flight, remember the first error."""
        if self.terminal:
            return
        self.advance(PullState.DRAIN)
        self.error, self.error_type = error, error_type
        self.drain_deadline = time.monotonic() + drain_s
        for leg in self.legs.values():
            for h in leg.handles:
                if h.state() is XferState.PENDING:
                    h.cancel()

    def reads_settled(self) -> None:
        """Every read is done: note when, and the transport's own time for them where it keeps one (NIXL's
        telemetry, as vLLM reports NixlConnector's transfers: first READ posted -> last seen done)."""
        self.mark("read_done")
        spans = [h.transport_span for leg in self.legs.values() for h in leg.handles]
        if spans and all(x is not None for x in spans):
            self.marks["transport_ms"] = (max(b for _, b in spans) - min(a for a, _ in spans)) / 1e3

    def near_end(self, now: float) -> bool:
        """Whether a read of this pull may end about now: from _NEAR_S before its transport's earliest possible
        end (TransferHandle.earliest_end) to _LATE_S after it; False where no transport gives one."""
        for leg in self.legs.values():
            for h in leg.handles:
                bound = getattr(h, "earliest_end", None)  # a TransferHandle's (fakes in tests may lack it)
                end = bound() if bound is not None else None
                if end is not None and end - _NEAR_S <= now <= end + _LATE_S:
                    return True
        return False

    def _first_post(self) -> None:
        if "first_post" not in self.marks:
            self.marks["first_post"] = time.monotonic()
            self.marks["first_read_unix"] = time.time()

    def _plans(self) -> PlanScratch:
        return self.scratch if self.scratch is not None else _scratch()

    def post_ready_layers(self, leg: Leg, local: RankPool, agent) -> None:
        """Plan and post reads for the layers of `leg` that became ready since the last call."""
        remote = leg.remote
        stage = remote.stage_of(leg.ctx_rank)
        ready_stop = min(leg.piece.layers.stop, stage.start + leg.layers_ready)
        start = max(leg.read_upto, leg.piece.layers.start)
        if ready_stop <= start:
            return
        if leg.remote_slot >= 0:  # staged: the newly packed layers are one byte range of the slot, one descriptor
            self._first_post()
            _sub, off, nb = layer_range(leg.piece, range(start, ready_stop), local.layout, self.num_tokens,
                                        self.from_token)  # layer-major slots: the unpack's offsets too
            one = np.ones(1, dtype=np.int64)
            mine = DescriptorList(one * (leg.slot + off), one * nb, *leg.slot_mem)
            theirs = DescriptorList(one * (leg.remote_slot + off), one * nb, *leg.remote_slot_mem)
            leg.handles.append(agent.read(leg.peer_name, mine, theirs))
            leg.ranges.append(range(start, ready_stop))
            leg.read_upto = ready_stop
            self.nbytes += nb
            self.fragments += 1
            self.staged = True
            return
        sub = Piece(leg.ctx_rank, range(start, ready_stop), leg.piece.heads)
        t0 = time.monotonic()
        # An agent that takes grids gets the plan as one (nothing per fragment on this thread but its
        # staging); otherwise, or when the plan is no grid, fragment arrays (from this thread's reused memory).
        args = (sub, remote, local, leg.ctx_blocks, self.blocks, self.num_tokens, self.from_token)
        grid = plan_grid(*args) if agent.grid_native else None
        frags: Fragments | None = None
        if grid is None:
            frags = plan_piece(*args, self._plans())
            leg.plans.append(frags.src)
        t1 = time.monotonic()
        self._first_post()
        if grid is not None:
            g = grid.length
            h = agent.read_grid(leg.peer_name,
                                DescriptorGrid(grid.dst_outer, grid.dst_inner, g, local.kind, local.device),
                                DescriptorGrid(grid.src_outer, grid.src_inner, g, remote.kind, remote.device))
        else:
            h = agent.read(leg.peer_name, DescriptorList(frags.dst, frags.length, local.kind, local.device),
                           DescriptorList(frags.src, frags.length, remote.kind, remote.device))
        self.marks["plan_s"] = self.marks.get("plan_s", 0.0) + t1 - t0
        self.marks["post_s"] = self.marks.get("post_s", 0.0) + time.monotonic() - t1
        leg.handles.append(h)
        leg.read_upto = ready_stop
        plan = grid if grid is not None else frags
        self.nbytes += plan.nbytes
        self.fragments += len(plan)

    def release(self, arena, unpack_timeout_s: float) -> None:
        """Terminal: release every transfer handle and free the staging slots into `arena`; a slot whose
        unpack is still running after `unpack_timeout_s` stays allocated (leaked, never reused). The plan
        arrays of a leg whose reads all settled go back to the pull's PlanScratch; a leg with a read still
        in flight (quarantine over) keeps them away from reuse."""
        jobs = [f for f in [self.verifying] + [u for leg in self.legs.values() for u in leg.unpacks] if f is not None]
        deadline = time.monotonic() + unpack_timeout_s
        for job in jobs:  # an unpack must not outlive its slot
            if job.cancelled():
                continue
            try:
                job.exception(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - timed out: the slots stay allocated
                log.error("request %d: unpack still running after %.1f s; keeping its slots", self.request_id,
                          unpack_timeout_s)
                for leg in self.legs.values():
                    leg.slot = None
                break
        scratch = self._plans()
        for leg in self.legs.values():
            settled = not leg.pending()  # nothing reads the plan arrays any more: the next plan may reuse them
            for h in leg.handles:
                h.release()
            for arr in leg.plans if settled else ():
                scratch.give(arr)
            leg.plans = []
            if leg.slot is not None:
                arena.free(leg.slot)
                leg.slot = None

    def result(self, agents: tuple[str, ...]) -> ReceiveResult:
        end = time.monotonic()
        t = {"total": (end - self.submitted) * 1e3}
        if "fetched" in self.marks:  # the first context rank's block ids arrived; reads start from here
            t["handshake+fetch"] = (self.marks["fetched"] - self.submitted) * 1e3
        if "plan_s" in self.marks:  # summed over legs and layer ranges; both inside "read"
            t["plan"] = self.marks["plan_s"] * 1e3
            t["post"] = self.marks["post_s"] * 1e3
        if "read_done" in self.marks and "fetched" in self.marks:
            t["read"] = (self.marks["read_done"] - self.marks["fetched"]) * 1e3
            t["confirm"] = (end - self.marks["read_done"]) * 1e3
            if "first_post" in self.marks:  # the reads alone: first READ posted -> last done (no planning)
                t["xfer"] = (self.marks["read_done"] - self.marks["first_post"]) * 1e3
            if "transport_ms" in self.marks:  # the same on the transport's own clock (NIXL telemetry)
                t["transport"] = self.marks["transport_ms"]
        if "first_read_unix" in self.marks:  # a wall-clock time (ms since the epoch), comparable across hosts'
            t["first_read_unix_ms"] = self.marks["first_read_unix"] * 1e3  # synchronised clocks: overlap proofs
        ok = self.state is PullState.DONE and not self.error
        return ReceiveResult(self.request_id, ok, self.error, self.error_type, self.nbytes, self.fragments, agents, t)
