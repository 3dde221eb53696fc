"""The connector's messages between the leader and the ranks: a plan section down, rank reports up.

Down, inside every step plan the engine builds (`StepPlan.conn`, msgpack, never pickle): a `ConnSection`
    [SECTION_VERSION, meta (the scheduler's ConnectorMetadata.to_wire() or None), saving ids, loading ids]
Up, after every step (also idle ones), all-gathered on the control group as msgpack bytes in tensors: a
`ConnReport` [saved ids, loaded ids, [[id, reason], ...] load errors].
The leader acts on an id once EVERY rank reported it (`Tally`): a load fails if any rank's failed.
Owns these two forms and their strict decoding (ProtocolError naming the field); never runs a connector.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...errors import ProtocolError

__all__ = ["SECTION_VERSION", "ConnSection", "ConnReport", "Tally", "exchange"]

SECTION_VERSION = 1


def _ids(v: Any, what: str) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple)) or not all(type(i) is int for i in v):
        raise ProtocolError(f"{what} must be a list of request ids, got {v!r:.120}")
    return tuple(v)


@dataclass(frozen=True, slots=True)
class ConnSection:
    """The connector's part of one step plan."""

    meta: Any = None        # the scheduler's ConnectorMetadata wire form, decoded by the worker's metadata_cls
    saving: tuple = ()      # request ids that started saving
    loading: tuple = ()     # request ids that started loading

    def to_wire(self) -> list:
        return [SECTION_VERSION, self.meta, list(self.saving), list(self.loading)]

    @classmethod
    def from_wire(cls, d: Any) -> "ConnSection":
        if not isinstance(d, list) or len(d) != 4 or type(d[0]) is not int or d[0] != SECTION_VERSION:
            raise ProtocolError(f"plan connector section: expected [{SECTION_VERSION}, meta, saving, loading], "
                                f"got {d!r:.120}")
        return cls(d[1], _ids(d[2], "plan connector section 'saving'"),
                   _ids(d[3], "plan connector section 'loading'"))


@dataclass(frozen=True, slots=True)
class ConnReport:
    """One rank's connector report for one step (its worker's get_finished and load errors)."""

    saved: tuple = ()
    loaded: tuple = ()
    errors: tuple = ()      # ((request id, reason), ...)

    def to_wire(self) -> list:
        return [list(self.saved), list(self.loaded), [[r, w] for r, w in self.errors]]

    @classmethod
    def from_wire(cls, d: Any, rank: int = 0) -> "ConnReport":
        what = f"rank {rank} connector report"
        if not isinstance(d, list) or len(d) != 3:
            raise ProtocolError(f"{what}: expected [saved, loaded, errors], got {d!r:.120}")
        errs = d[2]
        if not isinstance(errs, list) or not all(isinstance(e, list) and len(e) == 2 and type(e[0]) is int
                                                 and isinstance(e[1], str) for e in errs):
            raise ProtocolError(f"{what}: 'errors' must be [[request_id, reason], ...]")
        return cls(_ids(d[0], f"{what} 'saved'"), _ids(d[1], f"{what} 'loaded'"),
                   tuple((int(e[0]), e[1][:2000]) for e in errs))


def exchange(comm, report: ConnReport) -> list[ConnReport]:
    """Every rank's report, on every rank (rank order). Called by every rank after every step."""
    if not comm.enabled:
        return [report]
    return [ConnReport.from_wire(rep, r)
            for r, rep in enumerate(comm.all_gather_msgpack(report.to_wire(), "connector report"))]


class Tally:
    """Leader side: which ids every rank has reported saved / loaded, and the load errors seen so far."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.seen: dict[tuple[str, int], set[int]] = {}
        self.errors: dict[int, str] = {}

    def add(self, reports: list[ConnReport]) -> tuple[list[int], list[tuple[int, str]]]:
        """Fold in one round; returns (ids saved on every rank, [(id, error or "")] loaded on every rank)."""
        saved: list[int] = []
        loaded: list[tuple[int, str]] = []
        for rank, rep in enumerate(reports):
            for rid, why in rep.errors:
                self.errors.setdefault(rid, f"rank {rank}: {why}")
            for kind, out in (("saved", saved), ("loaded", loaded)):
                for rid in getattr(rep, kind):
                    s = self.seen.setdefault((kind, rid), set())
                    s.add(rank)
                    if len(s) == self.world:
                        del self.seen[(kind, rid)]
                        out.append(rid if kind == "saved" else (rid, self.errors.pop(rid, "")))
        return saved, loaded
