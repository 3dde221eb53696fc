"""The positional KV check through serving: a disaggregated request's KV on the generation worker, gathered by
its block table in token order, equals the context worker's byte for byte (executor/kv_check.py).

Token equality cannot see misplaced KV (a block-order bug decodes the same tokens), so a serving test that
compares tokens also calls `assert_kv_positional` with the handles its answers carry (`kvbridge.handle`).
Both workers need `executor: {kv_digests: true}`; each serves GET /internal/kv_digests?handle=H.

Exact only for KV that crossed, or was reused from the same prefill on both sides. A prefix the generation
worker reuses from its own cache was computed by an EARLIER context prefill; if the context worker meanwhile
recomputed part of that prefix (it evicted it, or its cache boundary differs), its layers >= 1 differ by
float rounding (a different batch shape), although nothing was misplaced. So the general serving tests run
the generation side without block reuse (every prompt pulled whole), and test_prefix_serving.py controls its
requests so that both caches hold the same prefill's KV.
"""

from __future__ import annotations

from typing import Any, Iterable

import httpx

from kvbridge.executor.kv_check import KVDigest, check_positional, from_json

from .cluster import HEADERS


def kv_digest(url: str, handle: int) -> KVDigest:
    """The digest worker `url` recorded of disaggregated request `handle` (fails the test if it has none)."""
    r = httpx.get(url + "/internal/kv_digests", params={"handle": str(handle)}, headers=HEADERS, timeout=60)
    assert r.status_code == 200, f"{url}: handle {handle}: {r.status_code} {r.text[:500]}"
    body = r.json()
    assert body["handle"] == handle, body
    return from_json(body["kv_digest"], f"{url}'s digest of handle {handle}")


def handles_of(kb: Any) -> list[int]:
    """The handles in a `kvbridge` object: one answer's, or every choice's of a fanned-out one."""
    if isinstance(kb, dict) and isinstance(kb.get("choices"), list):
        return [h for c in kb["choices"] for h in handles_of(c)]
    assert isinstance(kb, dict) and type(kb.get("handle")) is int, f"no handle in {kb!r:.300}"
    assert kb.get("recomputed") is not True, f"recomputed here, nothing crossed: {kb!r:.300}"
    return [kb["handle"]]


def assert_kv_positional(ctx_url: str, gen_url: str, handles: Iterable[int]) -> int:
    """Check every handle's KV position by position on both workers; returns how many were compared (each
    one must be found on both: a handle a worker does not know fails the test)."""
    hs = list(handles)
    assert hs, "no disaggregated request to check"
    assert len(set(hs)) == len(hs), f"a handle repeats: {hs}"
    for h in hs:
        ctx, gen = kv_digest(ctx_url, h), kv_digest(gen_url, h)
        assert ctx.num_tokens > 0 and ctx.digests, f"handle {h}: an empty digest"
        check_positional(ctx, gen, f"handle {h}")
    return len(hs)
