"""Worker pools of the router: which workers exist, which answered /health, and which one gets a request.

Policies:
    round_robin   the next healthy worker in turn
    least_loaded  the healthy worker with the fewest requests this router has in flight on it (ties in turn)
    prefix_aware  the worker most likely to hold the prompt's prefix in its KV cache (block reuse): a
                  rendezvous (highest-random-weight) hash of the request's routing key (`routing_key`: its
                  leading prompt tokens or text) over the healthy workers, so the turns of one conversation
                  land where its history is cached and removing a worker moves only its own keys; falls back
                  to the least loaded worker when the chosen one has PREFIX_LOAD_SLACK more requests in flight
                  than it, and to least_loaded for a request without a key.
    kv_aware      the worker whose cache (known from its KV events) and load cost least: kv_policy.py picks
                  among `candidates`; `pick` itself treats it as least_loaded.
A worker that refused a connection or failed /health is skipped until its /health answers 200 again; when
every worker of a pool looks unhealthy, they are tried anyway (health may be stale) rather than failing
without trying. Owns no sockets: the router polls /health and reports what it saw.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from .config import POLICIES, ServerSpec

__all__ = ["WorkerRef", "Pool", "routing_key", "PREFIX_KEY_TOKENS"]

PREFIX_KEY_TOKENS = 64    # leading prompt tokens (or 4x as many characters) that make a request's routing key
PREFIX_LOAD_SLACK = 4     # prefix_aware gives up affinity when its worker is this many requests busier


def routing_key(body: Any) -> bytes | None:
    """The prefix_aware routing key of an OpenAI-style request body: its leading prompt tokens, the leading
    characters of a text prompt, or of its chat messages; None when it has no prompt to key on.

    A conversation's turns share their leading tokens (system prompt + first user message), so they share a
    key; long enough (PREFIX_KEY_TOKENS) that conversations sharing only a system prompt spread out.
    """
    if not isinstance(body, dict):
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and \
            all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return b"t" + b",".join(str(t).encode() for t in prompt[:PREFIX_KEY_TOKENS])
    if isinstance(prompt, str) and prompt:
        return b"s" + prompt[:4 * PREFIX_KEY_TOKENS].encode("utf-8", "replace")
    msgs = body.get("messages")
    if isinstance(msgs, list) and msgs:
        text = json.dumps(msgs, sort_keys=True, default=str)[:4 * PREFIX_KEY_TOKENS]
        return b"m" + text.encode("utf-8", "replace")
    return None


def _weight(key: bytes, worker: str) -> bytes:
    return hashlib.blake2b(key + b"\0" + worker.encode(), digest_size=8).digest()


@dataclass
class WorkerRef:
    name: str
    url: str
    role: str
    healthy: bool = False  # until its /health answered 200 (requests still try it when none is healthy)
    in_flight: int = 0
    last_error: str = "not checked yet"
    capacity_tokens: int | None = None  # tokens its KV pool holds (from /health; None: not known)
    kv_events: dict | None = None  # a vLLM server's relayed KV events, from its registration

    @classmethod
    def of(cls, spec: ServerSpec) -> "WorkerRef":
        return cls(spec.name, spec.url, spec.role)

    def mark(self, healthy: bool, error: str = "") -> None:
        self.healthy = healthy
        if error:
            self.last_error = error


class Pool:
    """The workers of one role.

    Args:
        workers: the workers, in config order.
        policy: one of POLICIES.
    """

    def __init__(self, workers: list[WorkerRef], policy: str) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r} is not one of {POLICIES}")
        self.workers = list(workers)
        self.policy = policy
        self._next = 0

    def pick(self, exclude: set[str] = frozenset(), key: bytes | None = None,
             healthy_only: bool = False) -> WorkerRef | None:
        """The worker for the next request, not one named in `exclude`; None when none is left (or, with
        `healthy_only`, when none of those left is healthy). The turn moves past it.

        Args:
            exclude: workers already tried for this request.
            key: the request's `routing_key` (used by prefix_aware only).
            healthy_only: never fall back to a worker marked unhealthy.
        """
        w = self.peek(exclude, key, healthy_only)
        if w is not None:
            self.picked(w)
        return w

    def peek(self, exclude: set[str] = frozenset(), key: bytes | None = None,
             healthy_only: bool = False) -> WorkerRef | None:
        """The worker `pick` would choose, the turn left where it is (`picked` moves it once it is used)."""
        pool = self.candidates(exclude, healthy_only)
        if not pool:
            return None
        n = len(self.workers)
        order = sorted(pool, key=lambda w: (self.workers.index(w) - self._next) % n)
        least = min(order, key=lambda w: w.in_flight)
        if self.policy == "prefix_aware" and key is not None:
            w = max(pool, key=lambda w: _weight(key, w.name))
            if w.in_flight - least.in_flight >= PREFIX_LOAD_SLACK:
                w = least
        elif self.policy in ("least_loaded", "prefix_aware", "kv_aware"):
            w = least
        else:
            w = order[0]
        return w

    def candidates(self, exclude: set[str] = frozenset(), healthy_only: bool = False) -> list[WorkerRef]:
        """The workers `pick` chooses among: not excluded, healthy (or, unless `healthy_only`, all of those
        left when none is healthy), in turn order starting after the last pick."""
        left = [w for w in self.workers if w.name not in exclude]
        pool = [w for w in left if w.healthy] or ([] if healthy_only else left)
        n = len(self.workers)
        return sorted(pool, key=lambda w: (self.workers.index(w) - self._next) % n)

    def picked(self, w: WorkerRef) -> None:
        """`w` was chosen (by a policy outside this class): the turn moves past it."""
        self._next = (self.workers.index(w) + 1) % len(self.workers)

    def describe(self) -> str:
        return ", ".join(f"{w.name} ({'ok' if w.healthy else w.last_error or 'unhealthy'})"
                         for w in self.workers)
