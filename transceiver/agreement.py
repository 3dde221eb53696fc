"""Completion agreed by all ranks of an executor: a request is finished only when every rank finished it.

Used where an engine drives one CacheTransceiver per rank itself (kvbridge.trtllm's KvCacheTransceiver);
kvbridge's own executor agrees through its step reports (executor/hooks.py, HookTally). Pure bookkeeping:
it never waits; the all-gather it is given is the caller's (torch.distributed or anything else).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

__all__ = ["Agreement"]


class Agreement:
    """Completion agreed by all ranks of an executor.

    Each rank adds its locally finished results; `agree(all_gather)` exchanges the finished ids (all_gather
    takes this rank's list of ids and returns every rank's list) and returns the results finished on EVERY
    rank, each as (the local result, ok on every rank): a request another rank failed comes back with False.
    """

    def __init__(self) -> None:
        self._local: dict[int, Any] = {}

    def add(self, results: Iterable[Any]) -> None:
        for r in results:
            rid = getattr(r, "request_id", None)
            rid = r.ctx_request_id if rid is None else rid
            self._local[rid] = r

    def agree(self, all_gather: Callable[[list[int]], list[list[int]]]) -> list[tuple[Any, bool]]:
        """[(local result, ok on every rank)] for ids finished on every rank.

        What is gathered is a flat list of (id, ok) pairs, [id0, ok0, id1, ok1, ...]: ids may be any size
        (context request ids are random 64-bit numbers), no arithmetic packs them.
        """
        mine = sorted(self._local)
        flat = [v for rid in mine for v in (rid, 1 if _ok(self._local[rid]) else 0)]
        lists = all_gather(flat)
        done: dict[int, list[bool]] = {}
        for lst in lists:
            for rid, ok in zip(lst[0::2], lst[1::2]):
                done.setdefault(int(rid), []).append(bool(ok))
        out = []
        for rid in mine:
            oks = done.get(rid, [])
            if len(oks) == len(lists):
                out.append((self._local.pop(rid), all(oks)))
        return out


def _ok(r: Any) -> bool:
    if hasattr(r, "ok"):
        return bool(r.ok)
    return getattr(r, "status", "") == "complete"
