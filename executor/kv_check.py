"""Positional KV check: a request's KV as per (layer, kv-head) digests of its K and V in token order.

Token equality cannot see misplaced KV (RoPE is applied before the cache is written, so decode attention does
not depend on slot order): a block-order bug would still decode the right tokens. This module makes order
visible. Each rank hashes its share of a request's KV gathered by the request's block table in token order;
the digests are keyed by GLOBAL (layer, kv_head), so the context executor's digest and the generation
executor's digest compare directly whatever their TP/PP split or tokens_per_block (the remap from one layout
to the other is the key itself: heads split across TP ranks, layers across PP stages, blocks of any size).

    rank side   DigestBook.record(rid, kv)   at CtxDone (context) and Ready (generation) ops, when enabled
                DigestBook.report(rid, kv)   -> RankDigest (to the parent over the rank's pipe: a strict-codec
                                                message, strict.py; KVDigest.to_wire / from_wire)
    parent      merge(layout, {rank: RankDigest}) -> KVDigest;  mismatches(ctx, gen) -> [text, ...]
    serving     to_json(KVDigest) -> dict (a worker's GET /internal/kv_digests);  from_json(dict) -> KVDigest

Owns the digest form and the comparison. Never changes a pool, never runs on the transfer path: it is a
check for tests, the soak and debugging (ExecutorConfig.kv_digests turns the recording on).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

import torch
import xxhash

from ..errors import ExecutorError
from ..formatter.layout import KVLayout
from ..kvcache.manager import KVCacheManager
from .kv_io import gather_blocks
from .strict import Wire, need, wf

__all__ = ["KVDigest", "RankDigest", "DigestBook", "shard_digests", "merge", "mismatches",
           "check_positional", "to_json", "from_json", "DIGEST_VERSION"]

DIGEST_VERSION = 1  # bump when the canonical bytes or the hash change
MAX_RECORDED = 4096  # digests a rank keeps (oldest dropped first); a request's digest is taken once
_MAX_JSON_PAIRS = 1 << 16  # (layer, kv head) pairs a JSON digest may hold (from_json refuses more)
_HEX_DIGEST = re.compile(r"[0-9a-f]{16}")  # one xxh3-64 digest as xxhash writes it
_JSON_KEY = re.compile(r"(\d{1,6}),(\d{1,6})")  # "layer,kv_head"


Key = tuple[int, int]  # (global layer, global kv head)


@dataclass(frozen=True)
class KVDigest:
    """A request's KV (or one rank's share of it), position by position.

    Attributes:
        num_tokens: tokens hashed (the request's prompt when recorded at ctx_done / ready).
        dtype: the pool dtype (digests of different dtypes never compare equal).
        digests: (layer, kv_head) -> one xxh3-64 hex digest per kv index (K, then V) of that head's
            [num_tokens, head_dim] elements in token order.
    """

    num_tokens: int
    dtype: str
    digests: Mapping[Key, tuple[str, ...]]

    def to_wire(self) -> list:
        return [DIGEST_VERSION, self.num_tokens, self.dtype, [[k[0], k[1]] for k in self.digests],
                [list(v) for v in self.digests.values()]]

    @classmethod
    def from_wire(cls, d: Any) -> "KVDigest":
        """Decode strictly; ExecutorError naming the version or the bad field."""
        if not isinstance(d, list) or len(d) != 5:
            raise ExecutorError(f"KV digest: expected [version, num_tokens, dtype, keys, values], got {d!r:.80}")
        if type(d[0]) is not int or d[0] != DIGEST_VERSION:
            raise ExecutorError(f"KV digest: version {d[0]!r}, expected {DIGEST_VERSION}")
        n, dtype = need(d[1], int, "KV digest field 'num_tokens'"), need(d[2], str, "KV digest field 'dtype'")
        keys, values = need(d[3], list, "KV digest field 'keys'"), need(d[4], list, "KV digest field 'values'")
        if len(keys) != len(values):
            raise ExecutorError(f"KV digest: {len(keys)} keys but {len(values)} values")
        table: dict[Key, tuple[str, ...]] = {}
        for k, v in zip(keys, values):
            if (not isinstance(k, list) or len(k) != 2 or not all(type(i) is int for i in k)
                    or not isinstance(v, list) or not all(isinstance(s, str) for s in v)):
                raise ExecutorError(f"KV digest: bad entry {k!r:.40} -> {v!r:.80}")
            table[(k[0], k[1])] = tuple(v)
        return cls(n, dtype, MappingProxyType(table))


@dataclass(frozen=True, slots=True)
class RankDigest(Wire):
    """One rank's answer to a digest request (a message on the rank -> parent pipe, pipe_messages.py)."""

    request_id: int = wf(int)
    rank: int = wf(int)
    digest: KVDigest | None = wf(KVDigest, none=True)
    missing: str = wf(str, "")  # why there is no digest (never recorded, already taken, ...)


def shard_digests(layout: KVLayout, rank: int, pool: torch.Tensor, block_ids: list[int],
                  num_tokens: int) -> KVDigest:
    """The digest of `rank`'s share of a request held in `block_ids` (token order) of its block_major pool."""
    x = gather_blocks(pool, block_ids, num_tokens).cpu()  # [local_layers, kv_factor, local_heads, n, D]
    raw = x.view(torch.uint8) if x.numel() else x  # bytes of each element, whatever the dtype (bf16 too)
    tp_rank, pp_rank = layout.coords(rank)
    layers, heads = layout.stage_layers(pp_rank), layout.head_range(tp_rank)
    table: dict[Key, tuple[str, ...]] = {}
    for li, layer in enumerate(layers):
        for hi, head in enumerate(heads):
            table[(layer, head)] = tuple(xxhash.xxh3_64_hexdigest(raw[li, k, hi].contiguous().numpy().tobytes())
                                         for k in range(x.shape[1]))
    return KVDigest(int(num_tokens), layout.shape.dtype, MappingProxyType(table))


class DigestBook:
    """A rank's recorded digests (bounded; the oldest go first). Lives on the rank's main thread."""

    def __init__(self, layout: KVLayout, rank: int, limit: int = MAX_RECORDED) -> None:
        self.layout, self.rank, self.limit = layout, rank, limit
        self._book: OrderedDict[int, KVDigest] = OrderedDict()

    def record(self, request_id: int, kv: KVCacheManager) -> None:
        """Hash the request's KV as its blocks hold it now (every token it has)."""
        blocks = kv.get_batch_cache_indices([request_id])[0]
        self._book[request_id] = shard_digests(self.layout, self.rank, kv.pool, blocks, kv.num_tokens(request_id))
        self._book.move_to_end(request_id)
        while len(self._book) > self.limit:
            self._book.popitem(last=False)

    def report(self, request_id: int, kv: KVCacheManager) -> RankDigest:
        """The recorded digest (taken: a second report of it says missing), else one of a live request now."""
        d = self._book.pop(request_id, None)
        if d is None and request_id in kv:
            blocks = kv.get_batch_cache_indices([request_id])[0]
            d = shard_digests(self.layout, self.rank, kv.pool, blocks, kv.num_tokens(request_id))
        if d is None:
            return RankDigest(request_id, self.rank, None,
                              f"rank {self.rank} recorded no KV digest of request {request_id} (not a "
                              f"context-only or generation-only request of this executor, digests off, or "
                              f"already taken)")
        return RankDigest(request_id, self.rank, d)


def merge(layout: KVLayout, shards: Mapping[int, RankDigest]) -> KVDigest:
    """The whole request's digest from every rank's; replicated kv heads must agree across ranks."""
    if set(shards) != set(range(layout.world_size)):
        raise ExecutorError(f"kv digest needs every rank 0..{layout.world_size - 1}, got {sorted(shards)}")
    out: dict[Key, tuple[str, ...]] = {}
    first = None
    for r in sorted(shards):
        s = shards[r]
        if s.digest is None:
            raise ExecutorError(s.missing)
        d = s.digest
        first = first or d
        if (d.num_tokens, d.dtype) != (first.num_tokens, first.dtype):
            raise ExecutorError(f"rank {r} hashed {d.num_tokens} tokens of {d.dtype}, rank 0 "
                                f"{first.num_tokens} of {first.dtype}")
        for k, v in d.digests.items():
            if k in out and out[k] != v:
                raise ExecutorError(f"rank {r}'s replica of layer {k[0]} kv head {k[1]} differs from another "
                                    f"rank's")
            out[k] = v
    s = layout.shape
    want = {(layer, h) for layer in range(s.num_layers) for h in range(s.num_kv_heads)}
    if set(out) != want:
        raise ExecutorError(f"kv digest covers {len(out)} (layer, kv head) pairs, the model has {len(want)}")
    return KVDigest(first.num_tokens, first.dtype, MappingProxyType(dict(sorted(out.items()))))


def mismatches(ctx: KVDigest, gen: KVDigest, limit: int = 8) -> list[str]:
    """Where the generation side's KV differs from the context side's (empty: equal, position by position)."""
    if (ctx.num_tokens, ctx.dtype) != (gen.num_tokens, gen.dtype):
        return [f"context hashed {ctx.num_tokens} tokens of {ctx.dtype}, generation {gen.num_tokens} of "
                f"{gen.dtype}"]
    if set(ctx.digests) != set(gen.digests):
        return [f"context has {len(ctx.digests)} (layer, kv head) pairs, generation {len(gen.digests)}"]
    out = []
    for key, cv in ctx.digests.items():
        for k, (a, b) in enumerate(zip(cv, gen.digests[key])):
            if a != b:
                out.append(f"layer {key[0]} kv head {key[1]} {'KV'[k] if len(cv) == 2 else k}: context {a}, "
                           f"generation {b}")
    if len(out) > limit:
        out = out[:limit] + [f"... and {len(out) - limit} more"]
    return out


def check_positional(ctx: KVDigest, gen: KVDigest, what: str = "request") -> None:
    """Raise ExecutorError listing where the two differ; return quietly when equal byte for byte."""
    bad = mismatches(ctx, gen)
    if bad:
        raise ExecutorError(f"positional KV check of {what} failed: " + "; ".join(bad))


def to_json(d: KVDigest) -> dict:
    """The JSON form of a digest:
    {"version", "num_tokens", "dtype", "digests": {"layer,head": [K hex, V hex]}}."""
    return {"version": DIGEST_VERSION, "num_tokens": d.num_tokens, "dtype": d.dtype,
            "digests": {f"{k[0]},{k[1]}": list(v) for k, v in d.digests.items()}}


def from_json(obj: object, what: str = "kv digest") -> KVDigest:
    """A KVDigest from its JSON form (`to_json`), strictly: exactly those keys, ints that are not bools,
    16-digit lowercase hex digests, one or two (K, V) per (layer, kv head). Raises ExecutorError naming `what`
    and the field that was wrong."""
    if not isinstance(obj, dict) or set(obj) != {"version", "num_tokens", "dtype", "digests"}:
        keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise ExecutorError(f"{what}: expected an object with version, num_tokens, dtype and digests, got "
                            f"{keys!r:.120}")
    if obj["version"] != DIGEST_VERSION or type(obj["version"]) is not int:
        raise ExecutorError(f"{what}: version {obj['version']!r:.40}, expected {DIGEST_VERSION}")
    n, dtype, table = obj["num_tokens"], obj["dtype"], obj["digests"]
    if type(n) is not int or n < 0:
        raise ExecutorError(f"{what}: num_tokens is {n!r:.40}, expected an int >= 0")
    if not isinstance(dtype, str) or not 0 < len(dtype) <= 32:
        raise ExecutorError(f"{what}: dtype is {dtype!r:.40}, expected a dtype name")
    if not isinstance(table, dict) or not 0 < len(table) <= _MAX_JSON_PAIRS:
        raise ExecutorError(f"{what}: digests must be an object of 1..{_MAX_JSON_PAIRS} \"layer,head\" "
                            f"entries")
    out: dict[Key, tuple[str, ...]] = {}
    for k, v in table.items():
        m = _JSON_KEY.fullmatch(k)
        if m is None:
            raise ExecutorError(f"{what}: digests key {k!r:.40} is not \"layer,kv_head\"")
        if (not isinstance(v, list) or len(v) not in (1, 2)
                or not all(isinstance(x, str) and _HEX_DIGEST.fullmatch(x) for x in v)):
            raise ExecutorError(f"{what}: digests[{k!r}] is {v!r:.80}, expected 1 or 2 hex digests of 16 "
                                f"digits")
        out[(int(m.group(1)), int(m.group(2)))] = tuple(v)
    return KVDigest(n, dtype, MappingProxyType(out))
