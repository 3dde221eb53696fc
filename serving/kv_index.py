"""The router's index of the KV blocks each worker holds, built from the workers' KV events.

Per worker: the chained block hashes its prefix cache holds (each with its parent: a prefix tree over the
chain, rooted at the worker's fingerprint), in least-recently-useful order; plus speculative entries (the
blocks of prompts just routed there, valid for `spec_ttl_s`) so a burst of one prefix does not scatter before
the worker's own events arrive. Workers are added and removed explicitly (`add_worker` / `remove_worker`,
keyed by the router's worker name), so membership changes can drive it.

Bounded: at most `max_entries` confirmed entries over all workers; past it the least recently useful entry
of the largest worker is dropped (the router then under-estimates that worker's cache: a worse route, never
a wrong answer) and counted in `evicted`. Thread-safe (one lock): the event thread applies, the router's
event loop matches. Never opens a socket (kv_subscriber.py does) and never sees a token.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from ..executor.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from ..kvcache.prefix_tree import chain_keys

__all__ = ["KvIndex", "WorkerBlocks"]


@dataclass
class WorkerBlocks:
    """What the index knows of one worker."""

    fingerprint: str
    block_size: int
    incarnation: str = ""
    seq: int = 0                                    # last batch applied
    blocks: OrderedDict = field(default_factory=OrderedDict)  # hash -> parent (None: a first block)
    spec: dict = field(default_factory=dict)        # speculative hash -> expiry (monotonic)


class KvIndex:
    """Which worker holds which chained block hash.

    Args:
        max_entries: cap on confirmed (worker, block) entries over all workers.
        spec_ttl_s: how long a speculative entry counts.
    """

    def __init__(self, max_entries: int = 1_000_000, spec_ttl_s: float = 2.0) -> None:
        self.max_entries = int(max_entries)
        self.spec_ttl_s = float(spec_ttl_s)
        self.evicted = 0
        self._w: dict[str, WorkerBlocks] = {}
        self._lock = threading.Lock()
        self._size = 0

    # --- membership -----------------------------------------------------------------------------------
    def add_worker(self, wid: str, fingerprint: str, block_size: int, incarnation: str) -> None:
        """Start (or restart) tracking `wid`: whatever was known of it is dropped."""
        with self._lock:
            self._drop(wid)
            self._w[wid] = WorkerBlocks(fingerprint, int(block_size), incarnation)

    def remove_worker(self, wid: str) -> None:
        """The worker left: drop its blocks."""
        with self._lock:
            self._drop(wid)

    def workers(self) -> list[str]:
        with self._lock:
            return list(self._w)

    def info(self, wid: str) -> WorkerBlocks | None:
        return self._w.get(wid)

    @property
    def size(self) -> int:
        return self._size

    # --- ingest -----------------------------------------------------------------------------------------
    def load_dump(self, wid: str, seq: int, blocks: list) -> None:
        """Replace `wid`'s blocks with a full dump ([hash, parent|None, tokens] each) that reflects `seq`."""
        with self._lock:
            w = self._w.get(wid)
            if w is None:
                return
            self._size -= len(w.blocks)
            w.blocks = OrderedDict((bytes(h), p) for h, p, _n in blocks)
            self._size += len(w.blocks)
            w.seq = int(seq)
            self._bound()

    def apply(self, wid: str, seq: int, batch: KVEventBatch) -> None:
        """Apply batch `seq` (the caller keeps the order: seq == last applied + 1)."""
        with self._lock:
            w = self._w.get(wid)
            if w is None:
                return
            for e in batch.events:
                if isinstance(e, BlockStored):
                    parent = e.parent_block_hash
                    for h in e.block_hashes:
                        if h not in w.blocks:
                            self._size += 1
                        w.blocks[h] = parent
                        w.blocks.move_to_end(h)
                        w.spec.pop(h, None)
                        parent = h
                elif isinstance(e, BlockRemoved):
                    for h in e.block_hashes:
                        if w.blocks.pop(h, 0) != 0:
                            self._size -= 1
                elif isinstance(e, AllBlocksCleared):
                    self._size -= len(w.blocks)
                    w.blocks.clear()
            w.seq = int(seq)
            self._bound()

    # --- queries ------------------------------------------------------------------------------------------
    def keys_for(self, wid: str, tokens: list[int], cache: dict | None = None) -> list[bytes]:
        """The chained keys of `tokens`' full blocks as worker `wid` computes them (its fingerprint and block
        size); `cache` shares the work between workers of one layout."""
        w = self._w.get(wid)
        if w is None:
            return []
        ck = (w.fingerprint, w.block_size)
        if cache is not None and ck in cache:
            return cache[ck]
        keys = chain_keys(w.fingerprint, tokens, w.block_size)
        if cache is not None:
            cache[ck] = keys
        return keys

    def match(self, wid: str, keys: list[bytes]) -> tuple[int, int]:
        """(confirmed, with speculative): how many leading blocks of `keys` worker `wid` holds."""
        now = time.monotonic()
        with self._lock:
            w = self._w.get(wid)
            if w is None:
                return 0, 0
            n = 0
            while n < len(keys) and keys[n] in w.blocks:
                w.blocks.move_to_end(keys[n])  # useful: kept longest under the cap
                n += 1
            m = n
            while m < len(keys) and w.spec.get(keys[m], 0.0) > now:
                m += 1
            return n, m

    def speculate(self, wid: str, keys: list[bytes]) -> None:
        """`keys` were just routed to `wid`: count them as there for spec_ttl_s."""
        exp = time.monotonic() + self.spec_ttl_s
        with self._lock:
            w = self._w.get(wid)
            if w is None:
                return
            if len(w.spec) > 4 * len(keys) + 4096:  # expired ones go first; the dict stays small
                w.spec = {h: t for h, t in w.spec.items() if t > exp - self.spec_ttl_s}
            for h in keys:
                if h not in w.blocks:
                    w.spec[h] = exp

    def count(self, wid: str) -> int:
        """How many confirmed blocks the index holds of `wid` (0: none, or not tracked)."""
        w = self._w.get(wid)
        return len(w.blocks) if w is not None else 0

    def blocks_of(self, wid: str) -> dict[bytes, bytes | None]:
        """A copy of `wid`'s confirmed blocks (hash -> parent)."""
        with self._lock:
            w = self._w.get(wid)
            return dict(w.blocks) if w is not None else {}

    # --- internals ----------------------------------------------------------------------------------------
    def _drop(self, wid: str) -> None:
        w = self._w.pop(wid, None)
        if w is not None:
            self._size -= len(w.blocks)

    def _bound(self) -> None:
        while self._size > self.max_entries:
            big = max(self._w.values(), key=lambda x: len(x.blocks))
            big.blocks.popitem(last=False)
            self._size -= 1
            self.evicted += 1
