"""Names of stored KV: the namespace of a model + layout, and block keys chained over the prefix.

    namespace      = blake2b-128("kvbridge-kv-namespace/1", layout fingerprint, model spec, model config, extra)
    key(block 0)   = blake2b-256(namespace, 32 zero bytes, tokens of block 0 as little-endian int64)
    key(block i)   = blake2b-256(namespace, key(block i-1),   tokens of block i)

A block's KV depends on every token before it, so its key does too: the same tokens after a different
prefix get a different key. Only full blocks have keys. Never Python's hash() (salted per process); the
keys are the same on every machine, process and Python version.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...errors import KvBridgeError
from ...formatter.layout import KVLayout

__all__ = ["KEY_HEX", "block_keys", "namespace_for", "namespace_from"]

KEY_HEX = 64  # hex digits of a block key
_ROOT = bytes(32)


def namespace_for(layout: KVLayout, model: str, model_config: dict[str, Any] | None = None,
                  extra: str = "") -> str:
    """32 hex digits naming (layout, model): KV stored under one namespace is only loaded under it.

    Args:
        layout: the executor's layout (shape, dtype, tokens per block, TP/PP split: its fingerprint).
        model: the model spec (e.g. "smollm2", "seeded:tiny").
        model_config: the model's config dict (shapes, rope, eos...), canonicalised.
        extra: anything else that changes the KV (e.g. a weights revision the spec does not name).
    """
    return namespace_from("kvbridge-executor", layout.fingerprint(), model,
                          json.dumps(model_config or {}, sort_keys=True, default=str), extra)


def namespace_from(*parts: str) -> str:
    """32 hex digits naming whatever `parts` describe (each part is length-delimited, so none can alias)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"kvbridge-kv-namespace/1")
    for part in parts:
        b = str(part).encode()
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def block_keys(namespace: str, tokens: Sequence[int], tokens_per_block: int) -> list[str]:
    """Keys (64 hex digits) of the full blocks of `tokens`, in order; a trailing partial block has none.

    Raises:
        KvBridgeError: a token id is negative or does not fit in int64.
    """
    n = len(tokens) // tokens_per_block
    if n == 0:
        return []
    try:
        arr = np.asarray(tokens[:n * tokens_per_block], dtype=np.int64)
    except OverflowError:
        raise KvBridgeError("a token id does not fit in int64; cannot key its block") from None
    if arr.size and int(arr.min()) < 0:
        raise KvBridgeError(f"negative token id {int(arr.min())}; cannot key its block")
    rows = arr.astype("<i8").reshape(n, tokens_per_block)
    ns = bytes.fromhex(namespace)
    out, prev = [], _ROOT
    for row in rows:  # chained: each key needs the previous one (one blake2b call per block)
        h = hashlib.blake2b(ns, digest_size=32)
        h.update(prev)
        h.update(row.tobytes())
        prev = h.digest()
        out.append(prev.hex())
    return out
