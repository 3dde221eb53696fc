"""Prefix tree of reusable full KV blocks: chained block keys, token-confirmed hits, reference counts, LRU.

Owns three things of one rank's pool: which block ids hold a reusable FULL block (keyed by a hash chained over
every earlier token of the prefix and a layout/model fingerprint, so different models or splits never share a
key), how many live requests hold each block (reference counts), and the LRU order of cached blocks that no
request holds (these are evictable). It never allocates or frees pool memory and never reads the pool tensor:
the KVCacheManager asks it to match, hold, drop, register and evict.

A hit is confirmed on content, never on the hash alone: every cached block stores its tokens and its parent's
key, and `match` compares both, so a key collision makes a miss, not wrong KV. The key chain is the same on
every process with the same fingerprint (blake2b, no Python `hash`), so a router can compute it too.

    chain_keys(fp, tokens, tpb)      the keys of the full blocks of a token list (pure function)
    match(tokens, max_blocks)        read-only: block ids of the longest cached prefix
    hold(block) / drop(block)        a request takes / lets go of a block; drop says whether it is now free
    register(block, parent, tokens)  a request's block is full and its KV is written: make it reusable
    evict_one()                      the LRU cached block no request holds, removed from the tree
    listener                         optional: told of every block made reusable (stored) and evicted
                                     (removed), in order, on the caller's thread (kv_events.py publishes them)
    snapshot()                       (key, parent, tokens) of every cached block: what the listener was told
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["PrefixTree", "chain_keys", "root_key", "block_key", "KEY_VERSION"]

KEY_VERSION = b"kvbridge-prefix-v1"  # bump when the key recipe changes (keys from older peers never match)


def root_key(fingerprint: str) -> bytes:
    """The parent key of a prompt's first block (one per layout/model fingerprint)."""
    return hashlib.blake2b(KEY_VERSION + fingerprint.encode(), digest_size=16).digest()


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a full block holding `tokens`, after the prefix whose last key is `parent`."""
    return hashlib.blake2b(parent + np.asarray(tokens, dtype="<i8").tobytes(), digest_size=16).digest()


def chain_keys(fingerprint: str, tokens: Sequence[int], tokens_per_block: int,
               max_blocks: int | None = None) -> list[bytes]:
    """Keys of the full blocks of `tokens` (at most `max_blocks`), each chained over all earlier tokens."""
    n = len(tokens) // tokens_per_block
    if max_blocks is not None:
        n = min(n, max_blocks)
    keys, parent = [], root_key(fingerprint)
    for i in range(n):
        parent = block_key(parent, tokens[i * tokens_per_block:(i + 1) * tokens_per_block])
        keys.append(parent)
    return keys


@dataclass(frozen=True, slots=True)
class _Cached:
    key: bytes
    parent: bytes
    tokens: tuple[int, ...]


class PrefixTree:
    """Hash-chain dictionary of full blocks with reference counts and an LRU of the evictable ones.

    Args:
        num_blocks: blocks in the pool (ids 0 .. num_blocks - 1).
        tokens_per_block: tokens per block.
        fingerprint: identifies the layout and model; blocks of different fingerprints never match.
    """

    def __init__(self, num_blocks: int, tokens_per_block: int, fingerprint: str) -> None:
        self.tpb = int(tokens_per_block)
        self.fingerprint = fingerprint
        self.root = root_key(fingerprint)
        self._refs = [0] * int(num_blocks)
        self._by_key: dict[bytes, int] = {}
        self._meta: dict[int, _Cached] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks with no holder, oldest first
        self.listener = None  # .stored(key, parent, tokens) / .removed(key): see kv_events.KVEventLog

    # --- queries ------------------------------------------------------------------------------------
    @property
    def num_evictable(self) -> int:
        """Cached blocks no request holds (they count as free: the pool takes them back when it needs)."""
        return len(self._lru)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the tree (held or not)."""
        return len(self._meta)

    def refs(self, block: int) -> int:
        return self._refs[block]

    def is_cached(self, block: int) -> bool:
        return block in self._meta

    def match(self, tokens: Sequence[int], max_blocks: int) -> list[int]:
        """Block ids holding the longest cached prefix of `tokens` (at most `max_blocks` full blocks).

        Read-only. Each hit is confirmed on the block's stored tokens and parent key.
        """
        out: list[int] = []
        parent = self.root
        for i in range(min(max_blocks, len(tokens) // self.tpb)):
            toks = tuple(int(t) for t in tokens[i * self.tpb:(i + 1) * self.tpb])
            key = block_key(parent, toks)
            b = self._by_key.get(key)
            if b is None:
                break
            m = self._meta[b]
            if m.tokens != toks or m.parent != parent:  # a key collision: a miss, never wrong KV
                break
            out.append(b)
            parent = key
        return out

    # --- holders ------------------------------------------------------------------------------------
    def hold(self, block: int) -> None:
        """A request takes `block` (fresh from the free list, or a cached one it matched)."""
        self._refs[block] += 1
        self._lru.pop(block, None)

    def drop(self, block: int) -> bool:
        """A request lets go of `block`. Returns True when the block is now free (not cached, no holder)."""
        if self._refs[block] <= 0:
            raise ValueError(f"block {block} dropped more often than held")
        self._refs[block] -= 1
        if self._refs[block]:
            return False
        if block in self._meta:
            self._lru[block] = None  # most recently used end
            return False
        return True

    def register(self, block: int, parent: bytes, tokens: Sequence[int]) -> bytes:
        """`block` is full of the KV of `tokens` after the prefix keyed `parent`; returns its key.

        When another block already holds that key (two requests computed the same prefix at once), the
        tree keeps the first and this block stays private (freed, not cached, when its holder lets go).
        """
        toks = tuple(int(t) for t in tokens)
        key = block_key(parent, toks)
        if key not in self._by_key and block not in self._meta:
            self._by_key[key] = block
            self._meta[block] = _Cached(key, parent, toks)
            if not self._refs[block]:
                self._lru[block] = None
            if self.listener is not None:
                self.listener.stored(key, parent, toks)
        return key

    def evict_one(self) -> int | None:
        """Remove the least recently used unheld cached block from the tree and return it (None: none)."""
        if not self._lru:
            return None
        block, _ = self._lru.popitem(last=False)
        m = self._meta.pop(block)
        del self._by_key[m.key]
        if self.listener is not None:
            self.listener.removed(m.key)
        return block

    def snapshot(self) -> list[tuple[bytes, bytes, int]]:
        """(key, parent key, token count) of every cached block, in registration order."""
        return [(m.key, m.parent, len(m.tokens)) for m in self._meta.values()]
