"""The connector's worker side: one kvbridge rank over vLLM's KV tensors, driven once per engine step.

Runs in each vLLM worker process, called from the model runner's thread only; the transceiver's own I/O
threads do the talking and the transports move the bytes straight into and out of vLLM's cache tensors.
Owns the Sender (prefill role) and Receiver (decode role) of this rank and the map between vLLM's request
ids and kvbridge's ids. Never frees a block: it reports a request finished and vLLM frees it, so a block
under a read in flight is never handed back (the Sender reports a request only once its readers confirmed,
its lease ran out or it was cancelled; a failed pull is reported only after its reads settled).

Early decode (params.py): a streamed publish goes out before the forward with no layer ready; each
`layer_saved` (vLLM's save_kv_layer, after the attention layer wrote its KV) marks the request's layers up to
that one ready, `forward_done` (wait_for_save) all of them. Its finished send is held back until the
scheduler says vLLM finished the request (a read can end before the forward does, and vLLM frees the blocks
of a request it reports, running or not).
"""

from __future__ import annotations

import json
import logging
import os
import time
from itertools import count
from typing import Callable

from ...errors import LayoutError
from ...transceiver.cache_transceiver import agent_defaults
from ...transceiver.config import TransceiverConfig
from ...transceiver.params import DisaggParams
from ...transceiver.pool import LocalPool
from ...transceiver.receiver import Receiver
from ...transceiver.sender import Sender
from .layout import PACKED_ORDERS, CachePool, kv_digest, moved_tokens
from .packing import Packing
from .reblock import Reblocker
from .work import PullStats, StepWork

log = logging.getLogger(__name__)

__all__ = ["WorkerSide"]


class WorkerSide:
    """One vLLM worker's kvbridge rank.

    Args:
        pool: the worker's KV tensors as kvbridge sees them (layout.describe_caches).
        config: the transceiver's settings (kv_connector_extra_config["transceiver"]).
        instance: the engine's instance id (the same on all its workers).
        produce / consume: start a Sender (prefill role) / a Receiver (decode role).
        digest_dir: when set, write each request's positional KV digest there (tests, debugging).
        packing_of: the attention kernel's packing for a block size (packed caches: the CPU backend).
        staging_tokens: tokens a staging pool for another block size holds (reblock.py).
    """

    def __init__(self, pool: CachePool, config: TransceiverConfig, instance: str, produce: bool, consume: bool,
                 digest_dir: str | None = None, packing_of: Callable[[int], Packing] | None = None,
                 staging_tokens: int = 0) -> None:
        self.cache, self.config, self.digest_dir = pool, config, digest_dir
        packed = pool.layout.order in PACKED_ORDERS
        if packed and packing_of is None:
            raise LayoutError(f"a {pool.layout.order} cache needs its attention kernel's packing")
        self.packing = packing_of(pool.layout.shape.tokens_per_block) if packed and packing_of else None
        # the agents' defaults of every transceiver (a NIXL progress thread fast only while a peer reads this rank)
        self.pool = LocalPool(pool.layout, pool.rank, list(pool.buffers), pool.num_blocks, agent_defaults(config))
        try:
            self.sender = Sender(self.pool, config, instance) if produce else None
            self.receiver = Receiver(self.pool, config, instance) if consume else None
        except BaseException:
            self.pool.close()
            raise
        self.reblock = (Reblocker(pool, config, instance, packing_of, staging_tokens)
                        if consume and packed and packing_of else None)
        self._reblocked: dict[str, tuple[int, int, list[int]]] = {}  # req -> (handle, n, blocks)
        self._ids = count(1)
        self._sent: dict[int, str] = {}  # handle -> vLLM request id
        self._pulls: dict[int, tuple[str, int, int, list[int]]] = {}  # kvbridge id -> (req, handle, n, blocks)
        self._pull_of: dict[str, int] = {}
        self._done_recv: set[str] = set()
        self._failed: set[str] = set()
        self._stats: dict[str, PullStats] = {}
        self._release: set[str] = set()  # prefill requests that could not be published: free at once
        self._layer_pos: dict[str, int] = {}  # vLLM layer name -> its position among this rank's layers
        self._streaming: dict[int, int] = {}  # streamed handles of this forward -> layers marked ready
        self._unfinished: set[str] = set()  # streamed requests vLLM has not finished yet
        self._held: set[str] = set()  # ... whose send ended already: reported once vLLM finished them
        self._handle_of: dict[str, int] = {}  # streamed prefill request -> handle (cancel)
        self._published: dict[int, tuple[tuple[int, ...], int]] = {}  # streamed handle -> (blocks, tokens)

    @property
    def endpoint(self) -> str | None:
        return self.sender.endpoint if self.sender is not None else None

    def set_layer_names(self, names: list[str]) -> None:
        """This rank's vLLM layer names in kvbridge's order (the pool's buffers)."""
        self._layer_pos = {n: i for i, n in enumerate(names)}

    def apply(self, work: StepWork) -> None:
        """Act on one step's work: publish, start pulls, refuse, cancel. Never raises for one request."""
        for req_id in work.finished:
            self._unfinished.discard(req_id)
            if req_id in self._held:
                self._held.discard(req_id)
                self._release.add(req_id)
        for p in work.publishes:
            if self.sender is None:
                log.error("kvbridge: request %s asks for remote decode but this engine is not a producer", p.req_id)
                continue
            try:
                if p.handle in self._sent:
                    raise ValueError(f"handle {p.handle} is already published here")
                self.sender.publish(p.handle, p.block_ids, moved_tokens(p.num_tokens, self.cache.layout),
                                    0 if p.streamed else None, p.secret)
                self._sent[p.handle] = p.req_id
                if p.streamed:
                    self._streaming[p.handle] = 0
                    self._unfinished.add(p.req_id)
                    self._handle_of[p.req_id] = p.handle
                    self._published[p.handle] = (p.block_ids, p.num_tokens)
                else:
                    self._digest("ctx", p.handle, p.block_ids, p.num_tokens)
            except Exception as e:  # noqa: BLE001 - one request fails, the worker keeps serving
                log.error("kvbridge: publishing request %s failed (its blocks go back): %s", p.req_id, e)
                (self._held if p.streamed else self._release).add(p.req_id)
                if p.streamed:
                    self._unfinished.add(p.req_id)
        for req_id in work.send_cancels:
            h = self._handle_of.pop(req_id, None)
            if h is not None and self.sender is not None:
                self._streaming.pop(h, None)
                self.sender.cancel(h)
        for r in work.refusals:
            self._fail(r.req_id, r.reason)
        for p in work.pulls:
            self._start_pull(p)
        for params, n in work.withdraws:  # decode requests that finished before their pull began
            if self.receiver is not None:
                try:
                    self.receiver.withdraw(DisaggParams.from_dict(params), n)
                except Exception as e:  # noqa: BLE001 - the prefill then frees it at its pickup timeout
                    log.warning("kvbridge: withdrawing a pull that never began failed: %s", e)
        for req_id in work.cancels:
            rid = self._pull_of.get(req_id)
            if rid is not None and self.receiver is not None:
                self.receiver.cancel(rid)
            if req_id in self._reblocked:
                self.reblock.cancel(req_id)

    def layer_saved(self, layer_name: str) -> None:
        """vLLM wrote this layer's KV for every request of the forward: streamed requests may be read up to it."""
        if not self._streaming:
            return
        pos = self._layer_pos.get(layer_name)
        if pos is None:
            return
        for h, ready in self._streaming.items():
            if pos + 1 > ready:
                self._streaming[h] = pos + 1
                self.sender.mark_layers_ready(h, pos + 1)

    def forward_done(self) -> None:
        """The forward ended: every layer of the streamed requests is final (their positional digest written)."""
        if not self._streaming:
            return
        local = self.cache.layout.local_layers(self.cache.rank)
        streaming, self._streaming = self._streaming, {}
        for h, ready in streaming.items():
            if ready < local:
                self.sender.mark_layers_ready(h, local)
            e = self._published.get(h)
            if e is not None:
                self._digest("ctx", h, *e)

    def _start_pull(self, p) -> None:
        if self.receiver is None:
            self._fail(p.req_id, "this engine is not a consumer (kv_role kv_producer)")
            return
        rid = next(self._ids)
        try:
            disagg = DisaggParams.from_dict(p.disagg)
            ctx_T = disagg.ctx_layout.shape.tokens_per_block
            if self.packing is not None and ctx_T != self.cache.layout.shape.tokens_per_block:
                why = self.reblock.check(ctx_T, p.packing)
                if why:
                    self._fail(p.req_id, why)
                    return
                self.reblock.submit(p.req_id, disagg, list(p.block_ids), p.num_tokens, p.from_token)
                self._reblocked[p.req_id] = (disagg.ctx_request_id, p.num_tokens, list(p.block_ids))
                return
            if self.packing is not None and p.packing != self.packing.digest:
                self._fail(p.req_id, f"the prefill's attention kernel packs its blocks as {p.packing or 'unknown'}"
                                     f", this engine's as {self.packing.digest}: whole blocks would land wrong")
                return
            n = moved_tokens(p.num_tokens, self.cache.layout)
            self.receiver.submit(rid, disagg, list(p.block_ids), n, None, p.from_token)
        except Exception as e:  # noqa: BLE001
            self._fail(p.req_id, f"{type(e).__name__}: {e}")
            return
        self._pulls[rid] = (p.req_id, disagg.ctx_request_id, p.num_tokens, list(p.block_ids))
        self._pull_of[p.req_id] = rid

    def _fail(self, req_id: str, why: str) -> None:
        log.error("kvbridge: KV load of request %s failed: %s", req_id, why)
        self._done_recv.add(req_id)
        self._failed.add(req_id)
        self._stats[req_id] = PullStats(error=why)

    def wait_pulls(self, timeout: float) -> None:
        """A step with no forward: block (the GIL released) until one of this rank's pulls finished, at most
        `timeout` seconds; return at once when none is in flight or a result already waits. vLLM's engine would
        spin through empty steps meanwhile, taking the core (and the GIL) the reads run on."""
        if timeout > 0 and self.receiver is not None and self._pulls and not (self._done_recv or self._failed):
            self.receiver.wait_finished(timeout)

    def poll(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) vLLM request ids since the last poll."""
        sending, self._release = self._release, set()
        if self.sender is not None:
            for r in self.sender.poll_finished():
                req_id = self._sent.pop(r.ctx_request_id, None)
                if req_id is None:
                    continue
                self._handle_of.pop(req_id, None)
                self._published.pop(r.ctx_request_id, None)
                if req_id in self._unfinished:  # a streamed request vLLM still runs: reported once it finished
                    self._held.add(req_id)
                else:
                    sending.add(req_id)
                if r.status != "complete":
                    log.info("kvbridge: request %s released on rank %d as %s %s", req_id, self.cache.rank,
                             r.status, r.detail)
        if self.receiver is not None:
            for r in self.receiver.poll_finished():
                entry = self._pulls.pop(r.request_id, None)
                if entry is None:
                    continue
                req_id, handle, n, blocks = entry
                self._pull_of.pop(req_id, None)
                if r.ok:
                    self._digest("gen", handle, blocks, n)
                    self._done_recv.add(req_id)
                    self._stats[req_id] = PullStats(r.nbytes, float(r.timings_ms.get("total", 0.0)),
                                                    read_ms=float(r.timings_ms.get("xfer", 0.0)),
                                                    first_read_unix_ms=float(r.timings_ms.get(
                                                        "first_read_unix_ms", 0.0)),
                                                    transport_ms=float(r.timings_ms.get("transport", 0.0)))
                else:
                    self._fail(req_id, f"{r.error_type}: {r.error}")
        if self.reblock is not None:
            for s in self.reblock.poll():
                handle, n, blocks = self._reblocked.pop(s.key, (0, 0, []))
                if s.ok:
                    self._digest("gen", handle, blocks, n)
                    self._done_recv.add(s.key)
                    self._stats[s.key] = PullStats(s.nbytes, s.ms, read_ms=s.read_ms, transport_ms=s.transport_ms)
                else:
                    self._fail(s.key, s.error)
        recving, failed = self._done_recv, self._failed
        self._done_recv, self._failed = set(), set()
        return sending, recving, failed

    def take_stats(self) -> dict[str, PullStats]:
        stats, self._stats = self._stats, {}
        return stats

    def _digest(self, side: str, handle: int, block_ids, n: int) -> None:
        if not self.digest_dir:
            return
        try:  # a debugging aid: it may fail (disk, folder), it never fails the request or the engine
            d = kv_digest(self.cache, block_ids, n, self.packing)
            os.makedirs(self.digest_dir, exist_ok=True)
            path = os.path.join(self.digest_dir, f"{side}-{handle}-r{self.cache.rank}.json")
            with open(path + ".tmp", "w") as f:
                json.dump({"tokens": n, "rank": self.cache.rank, "at": time.time(), "digest": d}, f)
            os.replace(path + ".tmp", path)
        except Exception as e:  # noqa: BLE001
            log.warning("kvbridge: writing the KV digest of request %d to %s failed: %s", handle, self.digest_dir, e)

    def close(self) -> None:
        if self.reblock is not None:
            self.reblock.close()
        for part in (self.sender, self.receiver):
            if part is not None:
                part.close()
        self.pool.close()
