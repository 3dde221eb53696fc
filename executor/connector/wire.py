"""The connector's messages between the leader and the ranks: a plan section down, rank reports up.

Down, inside every step plan the engine builds (msgpack, never pickle):
    StepPlan.conn = {"v": 1, "meta": <the scheduler's ConnectorMetadata.to_wire() or None>,
                    "saving": [request ids that started saving], "loading": [ids that started loading]}
Up, after every step (also idle ones), all-gathered on the control group as msgpack bytes in tensors:
    {"saved": [ids], "loaded": [ids], "errors": [[id, reason], ...]}
The leader acts on an id once EVERY rank reported it (`Tally`): a load fails if any rank's failed.
"""

from __future__ import annotations

from typing import Any


from ...errors import ProtocolError

__all__ = ["SECTION_VERSION", "Tally", "exchange", "parse_report", "parse_section", "section"]

SECTION_VERSION = 1


def _ids(v: Any, what: str) -> list[int]:
    if not isinstance(v, list) or not all(type(i) is int for i in v):
        raise ProtocolError(f"{what} must be a list of request ids, got {v!r:.120}")
    return list(v)


def section(meta: Any, saving: list[int], loading: list[int]) -> dict:
    return {"v": SECTION_VERSION, "meta": meta, "saving": list(saving), "loading": list(loading)}


def parse_section(d: Any) -> tuple[Any, list[int], list[int]]:
    """(meta wire form, saving ids, loading ids) of a plan's connector section; ProtocolError if malformed."""
    if not isinstance(d, dict) or d.get("v") != SECTION_VERSION:
        raise ProtocolError(f"plan connector section: expected a map of version {SECTION_VERSION}, got {d!r:.120}")
    return d.get("meta"), _ids(d.get("saving"), "plan connector section 'saving'"), \
        _ids(d.get("loading"), "plan connector section 'loading'")


def parse_report(d: Any, rank: int) -> dict:
    what = f"rank {rank} connector report"
    if not isinstance(d, dict):
        raise ProtocolError(f"{what}: expected a map")
    errs = d.get("errors", [])
    if not isinstance(errs, list) or not all(isinstance(e, list) and len(e) == 2 and type(e[0]) is int
                                             and isinstance(e[1], str) for e in errs):
        raise ProtocolError(f"{what}: 'errors' must be [[request_id, reason], ...]")
    return {"saved": _ids(d.get("saved", []), f"{what} 'saved'"),
            "loaded": _ids(d.get("loaded", []), f"{what} 'loaded'"),
            "errors": [[int(e[0]), e[1][:2000]] for e in errs]}


def exchange(comm, report: dict) -> list[dict]:
    """Every rank's report, on every rank (rank order). Called by every rank after every step."""
    if not comm.enabled:
        return [parse_report(report, 0)]
    return [parse_report(rep, r) for r, rep in enumerate(comm.all_gather_msgpack(report, "connector report"))]


class Tally:
    """Leader side: which ids every rank has reported saved / loaded, and the load errors seen so far."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.seen: dict[tuple[str, int], set[int]] = {}
        self.errors: dict[int, str] = {}

    def add(self, reports: list[dict]) -> tuple[list[int], list[tuple[int, str]]]:
        """Fold in one round; returns (ids saved on every rank, [(id, error or "")] loaded on every rank)."""
        saved: list[int] = []
        loaded: list[tuple[int, str]] = []
        for rank, rep in enumerate(reports):
            for rid, why in rep["errors"]:
                self.errors.setdefault(rid, f"rank {rank}: {why}")
            for kind, out in (("saved", saved), ("loaded", loaded)):
                for rid in rep[kind]:
                    s = self.seen.setdefault((kind, rid), set())
                    s.add(rank)
                    if len(s) == self.world:
                        del self.seen[(kind, rid)]
                        out.append(rid if kind == "saved" else (rid, self.errors.pop(rid, "")))
        return saved, loaded
