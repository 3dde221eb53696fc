"""`policy: kv_aware`: route each hop to the worker where the prompt costs least, by the KV it really holds.

The router keeps a KvIndex (kv_index.py) fed by every worker's KV events (kv_subscriber.py); a worker's
/health (authenticated) advertises its event endpoints and incarnation, and `on_health` keeps the
subscription in step (a worker that stops answering is dropped from the index). For one request:

    context hop     cost(w) = uncached prompt blocks on w x prefill_weight
                              + blocks w is still prefilling for requests in flight x load_weight
                              + requests in flight on w x request_weight
    generation hop  cost(w) = prompt blocks w lacks (it pulls only those) x pull_weight
                              + requests in flight on w x decode_weight

With `local_prefill_tokens` N > 0, a request whose chosen generation worker already holds (confirmed by its
events) all but at most N of its prompt tokens skips the context hop: the generation worker prefills that short tail itself (no hop,
no pull); `kvbridge.route.local_prefill` says so. The generation hop then prices what each candidate would
really cost: one that may prefill the tail itself, the tail's blocks x prefill_weight + its decode load;
any other, its pull and decode load + the cheapest context hop (so a conversation's next turn goes to the
generation worker where its history now lives, unless that worker's load outweighs the context hop).

A block counts as cached when the worker's events say so, or when a prompt with it was routed there within
spec_ttl_s (speculative: a burst of one prefix then lands together instead of scattering before the first
prefill's events arrive). Ties go to the worker holding more of the prompt, then the less loaded, then in
turn. A prompt the router cannot tokenize
is routed least-loaded. The decision and its inputs go into the answer's `kvbridge.route` and the metrics
(hit and prompt tokens per role, index entries and evictions, event lag, gaps repaired, events refused).

Settings (router.kv_aware): prefill_weight, load_weight, request_weight, pull_weight, decode_weight,
spec_ttl_s, max_index_entries, replay_timeout_s, local_prefill_tokens (0: off). Needs the deployment's internal token (event signatures and
the subscriber's password or CurveZMQ key derive from it). When the deployment's control plane is CurveZMQ
(its groups' transceivers have keys, as under `kvbridge serve`), so are the event subscriptions: a worker
that advertises no Curve key is not followed, and one whose key differs from the public key this router's
config names for its role is refused (curve_keys.py). Never touches KV; opens sockets only through
KvEventsClient.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from ..errors import KvBridgeError, ServeConfigError
from ..executor.kv_events import derive_secret
from .auth import internal_token
from .balancer import Pool, WorkerRef
from .curve_keys import expected_server_keys, uses_curve
from .kv_index import KvIndex
from .kv_subscriber import KvEventsClient
from .router_spec import KV_AWARE_DEFAULTS

__all__ = ["KvRouting", "given_tokens", "shown"]

log = logging.getLogger("kvbridge.serving.kv_events")


def shown(route: dict) -> dict:
    """What the answer's `kvbridge` field shows of a request's routing ({"route": decisions}, no token ids)."""
    return {"route": {k: v for k, v in route.items() if k != "tokens"}}


def given_tokens(body: dict) -> list[int] | None:
    """A prompt the client gave as token ids (also as a list of one such list); None for any other prompt."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and all(type(t) is int and t >= 0 for t in prompt):
        return prompt
    return None


@functools.cache
def _families() -> tuple:
    from prometheus_client import Counter, Gauge

    return (Counter("kvbridge_router_kv_tokens", "kv_aware: prompt tokens routed and those the chosen "
                    "worker held", ["role", "kind"]),
            Gauge("kvbridge_router_kv_index", "kv_aware: the KV index (entries, evicted, gaps_repaired, "
                  "dumps, rejected_events, event_lag_seconds)", ["what"]),
            Gauge("kvbridge_router_kv_index_blocks", "kv_aware: blocks the index holds of each worker it follows",
                  ["worker"]))


class KvRouting:
    """The kv_aware policy of one router (its index, its subscriber, its in-flight prefill load)."""

    def __init__(self, cfg) -> None:
        token = internal_token(cfg)
        if not token:
            raise ServeConfigError("router.policy kv_aware needs the deployment's internal token (the KV events "
                                   "are signed with a key derived from it): set KVBRIDGE_INTERNAL_TOKEN or "
                                   "internal_token")
        self.s = {**KV_AWARE_DEFAULTS, **(cfg.router.kv_aware or {})}
        self.index = KvIndex(int(self.s["max_index_entries"]), float(self.s["spec_ttl_s"]))
        self.client = KvEventsClient(self.index, derive_secret(token), float(self.s["replay_timeout_s"]),
                                     require_curve=uses_curve(cfg))
        self._server_keys = expected_server_keys(cfg)  # role -> the public key its config names
        self._model = cfg.model
        self._codec = None
        self._pending: dict[str, int] = {}  # worker -> uncached blocks of its context hops in flight
        self.tokens_c, self.gauge, self.blocks_g = _families()
        self._followed: set[str] = set()  # workers with a kvbridge_router_kv_index_blocks series

    def close(self) -> None:
        self.client.close()

    # --- membership: the router's health checks, and the workers that join or leave ------------------------
    def forget(self, w: WorkerRef) -> None:
        """`w` left the deployment (membership removed it): its blocks leave the index now, its events are no
        longer followed, its in-flight prefill load is forgotten."""
        self.index.remove_worker(w.name)
        self.client.remove_worker(w.name)
        self._pending.pop(w.name, None)
        if w.name in self._followed:
            self._followed.discard(w.name)
            self.blocks_g.remove(w.name)

    def on_health(self, w: WorkerRef, body: Any) -> None:
        """What `w`'s /health said (None: it did not answer): follow its events, or drop its blocks. A worker
        that joins is checked at once (membership's on_added), so it is dumped, then followed, from there."""
        info = body.get("kv_events") if isinstance(body, dict) else None
        if isinstance(info, dict) and all(isinstance(info.get(k), str) for k in ("pub", "replay", "incarnation")):
            got = {k: info[k] for k in ("pub", "replay", "incarnation", "curve_server_key")
                   if isinstance(info.get(k), str)}
            want = self._server_keys.get(w.role)
            if want is not None and got.get("curve_server_key") != want:
                log.warning("kv events: not following %s: its CurveZMQ key is not the %s key this router's "
                            "config names", w.name, w.role)
                self.client.remove_worker(w.name)
            else:
                self.client.sync_worker(w.name, got)
                if w.name not in self._followed:
                    self._followed.add(w.name)
                    self.blocks_g.labels(w.name).set_function(lambda n=w.name: self.index.count(n))
        elif body is None:
            self.client.remove_worker(w.name)
        st = self.client.stats
        for k, v in (("entries", self.index.size), ("evicted", self.index.evicted),
                     ("gaps_repaired", st["gaps_repaired"]), ("dumps", st["dumps"]),
                     ("rejected_events", st["rejected"]), ("event_lag_seconds", st["event_lag_s"])):
            self.gauge.labels(k).set(v)

    # --- one request -------------------------------------------------------------------------------------
    def tokens(self, body: dict) -> list[int] | None:
        """The prompt's token ids as the workers will see them (None: cannot tell)."""
        given = given_tokens(body)
        if given is not None:
            return given
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        try:
            if self._codec is None:
                from .text import TextCodec

                self._codec = TextCodec(self._model)
            if isinstance(prompt, str):
                return self._codec.encode(prompt)
            if isinstance(body.get("messages"), list):
                return self._codec.encode(self._codec.chat_prompt(body["messages"]))
        except (KvBridgeError, ValueError, TypeError):
            return None
        return None

    def pick(self, pool: Pool, role: str, tokens: list[int] | None, exclude: set[str] = frozenset(),
             healthy_only: bool = False, context: Pool | None = None) -> tuple[WorkerRef | None, dict | None]:
        """The cheapest worker of `pool` for a prompt of `tokens`, and the decision (for kvbridge.route).

        For the generation hop with local_prefill_tokens on, `context` (the context pool) prices the context
        hop a candidate would need: a candidate that may prefill the tail itself costs that tail, any other
        its pull plus the cheapest context hop (so a conversation's next turn goes where its history lives)."""
        cands = pool.candidates(exclude, healthy_only)
        if not cands:
            return None, None
        if tokens is None:
            w = min(cands, key=lambda x: x.in_flight)
            pool.picked(w)
            return w, {"worker": w.name, "reason": "no token ids: least loaded"}
        cache: dict = {}
        rows = {w.name: self._row(w, role, tokens, cache) for w in cands}
        if role == "generation" and context is not None and self.s["local_prefill_tokens"] > 0:
            self._price_context_hop(rows, context, tokens, cache)
        # ties: the worker holding more of the prompt, then the less loaded, then in turn (min is stable)
        best = min(cands, key=lambda x: (rows[x.name]["cost"], -rows[x.name]["_held"], x.in_flight))
        pool.picked(best)
        row = rows[best.name]
        self.index.speculate(best.name, row["_keys"])
        if role == "context":
            self._pending[best.name] = self._pending.get(best.name, 0) + row["uncached_blocks"]
        self.tokens_c.labels(role, "prompt").inc(len(tokens))
        self.tokens_c.labels(role, "hit").inc(row["hit_tokens"])
        for r in rows.values():
            for k in ("_keys", "_held", "_bs"):
                r.pop(k)
        return best, {"worker": best.name, "cost": row["cost"], "hit_tokens": row["hit_tokens"],
                      "prompt_tokens": len(tokens), "candidates": rows}

    def _row(self, w: WorkerRef, role: str, tokens: list[int], cache: dict) -> dict:
        """One candidate's inputs and cost (side-effect free but for the index's recency of its hits)."""
        s = self.s
        keys = self.index.keys_for(w.name, tokens, cache)
        info = self.index.info(w.name)
        bs = info.block_size if info is not None else 0
        hit, spec = self.index.match(w.name, keys)
        lacks = (len(tokens) // bs if bs else 0) - spec
        if role == "context":
            pend = self._pending.get(w.name, 0)
            cost = lacks * s["prefill_weight"] + pend * s["load_weight"] + w.in_flight * s["request_weight"]
        else:
            pend = 0
            cost = lacks * s["pull_weight"] + w.in_flight * s["decode_weight"]
        return {"hit_tokens": hit * bs, "spec_tokens": (spec - hit) * bs, "uncached_blocks": lacks,
                "pending_blocks": pend, "in_flight": w.in_flight, "cost": round(cost, 3),
                "known": info is not None, "_keys": keys, "_held": spec * bs, "_bs": bs}

    def _price_context_hop(self, rows: dict, context: Pool, tokens: list[int], cache: dict) -> None:
        """Generation candidates under local_prefill_tokens: one whose confirmed blocks hold all but a short tail
        of the prompt (it would prefill the tail itself, `local_tail_tokens`) costs those tail blocks at
        prefill_weight plus its decode load; any other its pull and decode load plus the cheapest context hop
        (`context_cost`). Speculative blocks do not make a tail short: they may still be on their way, and the
        generation worker would then prefill them too."""
        s, n = self.s, int(self.s["local_prefill_tokens"])
        ctx = [self._row(c, "context", tokens, cache)["cost"] for c in context.candidates(frozenset(), True)]
        hop = min(ctx, default=0.0)
        for r in rows.values():
            tail = len(tokens) - r["hit_tokens"]
            if r["hit_tokens"] and tail <= n:
                r["local_tail_tokens"] = tail
                lacks = (len(tokens) - r["hit_tokens"]) // r["_bs"]
                r["cost"] = round(lacks * s["prefill_weight"] + r["in_flight"] * s["decode_weight"], 3)
            else:
                r["context_cost"] = hop
                r["cost"] = round(r["cost"] + hop, 3)

    def local_prefill(self, route: dict) -> bool:
        """Whether the generation worker chosen in `route` should prefill the prompt's uncached tail itself
        (it holds all but at most local_prefill_tokens of it); marks `route` when so."""
        n, g = int(self.s["local_prefill_tokens"]), route.get("generation") or {}
        row = (g.get("candidates") or {}).get(g.get("worker"))
        if n <= 0 or row is None or not g.get("prompt_tokens"):
            return False
        tail = g["prompt_tokens"] - row["hit_tokens"]  # confirmed blocks only: speculative ones may be in flight
        if tail > n or not row["hit_tokens"]:
            return False
        route["local_prefill"] = {"tail_tokens": tail}
        self.tokens_c.labels("generation", "local_prefill").inc(tail)
        return True

    def settle(self, w: WorkerRef, decision: dict | None) -> None:
        """`w`'s context hop for `decision` ended: its blocks no longer count as load."""
        if decision and w.name in self._pending and "candidates" in decision:
            n = decision["candidates"][w.name]["uncached_blocks"]
            self._pending[w.name] = max(0, self._pending[w.name] - n)
