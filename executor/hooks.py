"""Rank hooks: how a per-rank component (the transceiver) lives inside every rank process of an executor.

An executor started with `ExecutorConfig(rank_hook="pkg.module:factory", rank_hook_args={...})` calls
`factory(RankContext)` in EVERY rank process once its pool exists, and then calls the hook from that rank's
step loop, in lockstep with the other ranks (all hooks run on the rank's main thread, between steps):

    on_context_done(request_id, block_ids, num_tokens, first_token)
        a context-only prefill finished (called at the start of the step after it, when the leader knows the
        first token); its blocks are pinned on this rank until the request is released.
    on_context_start(request_id, block_ids, num_tokens)   (optional; ExecutorConfig.stream_layers > 0)
        a context-only prefill is about to run on these (allocated) blocks: publish it, nothing readable yet.
    on_layers_ready(request_id, layers)                   (optional; with on_context_start)
        the first `layers` LOCAL layers of the request hold their final KV (called from inside the forward
        pass, executor/streaming.py: return at once). on_context_done still follows the prefill.
    on_generation_alloc(request_id, block_ids, prompt_len, ctx_info)
        a generation-only request got blocks on this rank: receive the prompt KV of this rank's layers and
        heads into them. ctx_info is the dict given to Executor.add_generation (e.g. where the context is).
    on_abort(request_id)          (optional)
        the executor aborted a context-only request that is still pinned or a generation-only request still
        waiting for its KV: stop moving it. Its blocks stay taken until every rank reported the request
        ("release", "abort" or "kv_ready") once more, so a transfer can never write into reused blocks.
    poll() -> {"kv_ready": [ids], "release": [ids], "abort": [ids]}
        called after every step (also idle ones, about every HOOK_IDLE_S). Report what finished ON THIS RANK:
        "kv_ready"  a generation-only request's KV arrived here;
        "release"   this rank is done sending a context-only request's blocks;
        "abort"     a transfer failed here (a generation request is aborted, a context one released).
        "notes"     optional [[request_id, text], ...]: why a request was aborted (short text; the leader
                    passes it on in the request's Done event).
        "stats"     optional [[request_id, TransferStats], ...] (transceiver/stats.py): what a generation
                    request's pull moved here (the lowest rank's reaches Completion.transfer).
        The leader acts once EVERY rank reported kv_ready / release for a request (any abort acts at once),
        so no rank decodes from, or frees, blocks another rank still uses.
    close()
        the executor is stopping.

A hook must not free, pin or unpin blocks itself, nor block for long: it returns quickly and reports later.
Reports travel between ranks as msgpack bytes in tensors (all-gather on the control group), never pickle.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..errors import ExecutorError, ProtocolError
from ..formatter.layout import KVLayout
from ..kvcache.manager import KVCacheManager
from ..transceiver.stats import TransferStats
from .config import ModelConfig
from .strict import Wire, wf

__all__ = ["RankHook", "RankContext", "load_hook", "HookTally", "HookReport", "Agreed", "REPORT_KINDS",
           "validate_report", "exchange_reports"]

REPORT_KINDS = ("kv_ready", "release", "abort")
HOOK_IDLE_S = 0.01


class RankHook(Protocol):
    def on_context_done(self, request_id: int, block_ids: list[int], num_tokens: int,
                        first_token: int) -> None:
        ...

    def on_generation_alloc(self, request_id: int, block_ids: list[int], prompt_len: int,
                            ctx_info: dict) -> None: ...

    def poll(self) -> dict[str, list[int]]: ...

    def close(self) -> None: ...


@dataclass
class RankContext:
    """What a hook gets: its rank, the executor's layout, the rank's KV manager (kv.pool is the pool tensor,
    registered once by a transfer agent), its device, the model config and the hook's own args."""

    rank: int
    layout: KVLayout
    kv: KVCacheManager
    device: torch.device
    model_config: ModelConfig
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def pool(self) -> torch.Tensor:
        return self.kv.pool


def load_hook(spec: str, ctx: RankContext) -> RankHook:
    """Import "module:factory" and build the rank's hook."""
    mod, _, fn = spec.partition(":")
    if not mod or not fn:
        raise ExecutorError(f"rank_hook {spec!r} is not 'module:factory'")
    try:
        factory = getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError) as e:
        raise ExecutorError(f"rank_hook {spec!r} cannot be loaded: {e}") from None
    return factory(ctx)


@dataclass(frozen=True, slots=True)
class Note(Wire):
    """Why a request was aborted on one rank (short text)."""

    rid: int = wf(int)
    text: str = wf(str)


@dataclass(frozen=True, slots=True)
class ReportedStats(Wire):
    """What one generation request's pull moved on one rank."""

    rid: int = wf(int)
    stats: TransferStats = wf(TransferStats)


@dataclass(frozen=True, slots=True)
class HookReport(Wire):
    """One rank's checked hook report for one step: what is the leader's to agree on (`HookTally`).

    The hook itself returns the documented dict from poll(); `validate_report` turns it into this type once,
    and this type is what crosses ranks (all-gathered as its wire form) and reaches the leader.
    """

    kv_ready: list = wf(list, [])
    release: list = wf(list, [])
    abort: list = wf(list, [])
    notes: tuple = wf(list, (), of=Note)
    stats: tuple = wf(list, (), of=ReportedStats)

    def ids(self, kind: str) -> list[int]:
        """The request ids of one of REPORT_KINDS."""
        return getattr(self, kind)

    def checked(self, rank: int) -> "HookReport":
        """Self, after checking every id list holds request ids (ints); ExecutorError naming the rank."""
        for k in REPORT_KINDS:
            if not all(type(i) is int for i in self.ids(k)):
                raise ExecutorError(f"rank {rank}: hook report {k!r} must be request ids, got {self.ids(k)!r:.200}")
        return self


NO_REPORT = HookReport()


def validate_report(rep: Any, rank: int) -> HookReport:
    """A hook's poll() dict checked and typed. Raises ExecutorError naming what was wrong."""
    if not isinstance(rep, dict) or set(rep) - {*REPORT_KINDS, "notes", "stats"}:
        raise ExecutorError(f"rank {rank}: hook poll() must return a dict with keys from {REPORT_KINDS} (and "
                            f"optional 'notes', 'stats'), got {rep!r:.200}")
    notes = rep.get("notes", [])
    if not isinstance(notes, (list, tuple)) or not all(
            isinstance(w, (list, tuple)) and len(w) == 2 and type(w[0]) is int and isinstance(w[1], str)
            for w in notes):
        raise ExecutorError(f"rank {rank}: hook poll()['notes'] must be [[request_id, text], ...], "
                            f"got {notes!r:.200}")
    ids = {}
    for k in REPORT_KINDS:
        got = rep.get(k, [])
        if not isinstance(got, (list, tuple)) or not all(type(i) is int for i in got):
            raise ExecutorError(f"rank {rank}: hook poll()[{k!r}] must be a list of request ids, "
                                f"got {got!r:.200}")
        ids[k] = [int(i) for i in got]
    return HookReport(**ids, notes=tuple(Note(int(w[0]), str(w[1])[:2000]) for w in notes),
                      stats=_typed_stats(rep.get("stats", []), rank))


def _typed_stats(stats: Any, rank: int) -> tuple:
    if not isinstance(stats, (list, tuple)) or not all(
            isinstance(w, (list, tuple)) and len(w) == 2 and type(w[0]) is int for w in stats):
        raise ExecutorError(f"rank {rank}: hook poll()['stats'] must be [[request_id, TransferStats], ...], "
                            f"got {stats!r:.200}")
    out = []
    for rid, st in stats:
        try:
            st = st if isinstance(st, TransferStats) else TransferStats.from_wire(st)
        except ProtocolError as e:
            raise ExecutorError(f"rank {rank}: hook poll()['stats'] of request {rid}: {e}") from None
        out.append(ReportedStats(rid, st))
    return tuple(out)


def exchange_reports(comm, report: HookReport) -> list[HookReport]:
    """All-gather every rank's report (its wire form: msgpack bytes in uint8 tensors on the control group)."""
    if not comm.enabled:
        return [report]
    return [HookReport.from_wire(rep).checked(r)
            for r, rep in enumerate(comm.all_gather_msgpack(report.to_wire(), "hook report"))]


@dataclass(frozen=True)
class Agreed:
    """What one round of reports settled (`HookTally.add`): request ids per outcome."""

    kv_ready: list = field(default_factory=list)  # every rank has the KV: decode
    release: list = field(default_factory=list)   # every rank is done sending: free the context blocks
    abort: list = field(default_factory=list)     # some rank failed: end the request now
    settled: list = field(default_factory=list)   # every rank reported something terminal: blocks may go


class HookTally:
    """Leader side: what every rank has reported for each request.

    kv_ready / release are agreed when EVERY rank reported them; abort as soon as ANY rank did (the client
    hears at once); "settled" when every rank reported something terminal for the request (kv_ready, release
    or abort) — only then may an aborted request's blocks be freed, since a rank still pulling or serving
    could otherwise write into reused blocks. An abort's note (its reason) wins over other notes.
    """

    def __init__(self, world: int) -> None:
        self.world = world
        self.seen: dict[tuple[str, int], set[int]] = {}
        self.reported: dict[int, set[int]] = {}  # rid -> ranks that reported anything terminal
        self.aborted: set[int] = set()
        self.notes: dict[int, str] = {}  # abort reasons, kept until `take_note`
        self._note_rank: dict[int, tuple[int, int]] = {}
        self.stats: dict[int, tuple[int, TransferStats]] = {}  # rid -> (rank, its stats), until `take_stats`

    def add(self, reports: list[HookReport]) -> Agreed:
        """Fold in one round of reports (one per rank, in rank order); returns what is now agreed on."""
        done = Agreed()
        for rank, rep in enumerate(reports):
            self._fold_notes(rank, rep)
            for kind in REPORT_KINDS:
                for rid in rep.ids(kind):
                    self.reported.setdefault(rid, set()).add(rank)
                    if kind == "abort":
                        if rid not in self.aborted:
                            self.aborted.add(rid)
                            done.abort.append(rid)
                        continue
                    s = self.seen.setdefault((kind, rid), set())
                    s.add(rank)
                    if len(s) == self.world and rid not in self.aborted:
                        getattr(done, kind).append(rid)
        for rid in [r for r, ranks in self.reported.items() if len(ranks) == self.world]:
            done.settled.append(rid)
            del self.reported[rid]
            self.aborted.discard(rid)
            for kind in ("kv_ready", "release"):
                self.seen.pop((kind, rid), None)
        return done

    def _fold_notes(self, rank: int, rep: HookReport) -> None:
        """Keep each request's note (an abort's reason first, then the lowest rank's) and stats (lowest rank)."""
        aborts = set(rep.abort)
        for n in rep.notes:
            prio = (0 if n.rid in aborts else 1, rank)
            if n.rid not in self._note_rank or prio < self._note_rank[n.rid]:
                self._note_rank[n.rid] = prio
                self.notes[n.rid] = n.text if rank == 0 else f"rank {rank}: {n.text}"
        for st in rep.stats:  # (an aborted request's later stats are never taken)
            if st.rid not in self.aborted and (st.rid not in self.stats or rank < self.stats[st.rid][0]):
                self.stats[st.rid] = (rank, st.stats)

    def take_note(self, rid: int) -> str:
        """The note reported for `rid` (lowest rank's), forgotten once taken."""
        self._note_rank.pop(rid, None)
        return self.notes.pop(rid, "")

    def take_stats(self, rid: int) -> TransferStats | None:
        """The transfer stats reported for `rid` (lowest rank's), forgotten once taken."""
        got = self.stats.pop(rid, None)
        return None if got is None else got[1]
