"""The connector's scheduler side: which request publishes, which pulls, and what the client is told.

Runs in vLLM's engine-core process, called by vLLM's scheduler thread only (no locks). Never touches KV or
sockets: it decides, and the workers (worker.py) act on the `StepWork` it hands them through vLLM's
connector metadata. Request handles and secrets come from one RequestKey per engine start, so they are
unguessable and a restarted prefill engine's old handles name nothing.

    prefill: request_finished(do_remote_decode) -> Publish (blocks stay vLLM's until every worker reports
             the request finished sending: read and confirmed, lease expired, or cancelled)
    early:   matched_tokens(kvbridge_early) -> the step that runs the prompt's last chunk -> Publish(streamed)
             (layers marked ready by the forward) -> request_finished -> Finished (its sends may be reported)
    decode:  matched_tokens -> after_alloc -> Pull (or Refuse: bad params fail the load, nothing is pulled)
             request_finished while pulling -> cancel; scheduled again after its pull (preempted): local prefill
             request_finished before its pull began (aborted while it waited, or its prompt all cached here)
             -> Withdraw: the workers tell the prefill they will not read, so it frees the KV now
"""

from __future__ import annotations

import logging
from typing import Any

import xxhash

from ...errors import ProtocolError
from ...formatter.layout import KVLayout, KVShape
from ...formatter.mapping import mapping_for
from ...transceiver.handles import RequestKey
from ...transceiver.params import DisaggParams
from .layout import PACKED_ORDERS
from .params import (KEY, EarlyPublish, RemotePrefill, bound_secret, early_publish_of, prefill_answer,
                     remote_prefill_of, wants_remote_decode)
from .work import Publish, Pull, PullStats, Refuse, StepWork

log = logging.getLogger(__name__)

__all__ = ["SchedulerSide", "prompt_hash"]


def prompt_hash(token_ids, n: int) -> str:
    """xxh3-64 of the first n prompt token ids (int64 little-endian): a decode request must hold the prompt its
    KV was computed for."""
    import numpy as np

    return xxhash.xxh3_64_hexdigest(np.asarray(list(token_ids)[:n], dtype="<i8").tobytes())


class SchedulerSide:
    """Scheduler-side state of one vLLM engine.

    Args:
        instance: the engine's kvbridge instance id (the same on every worker).
        local_layout: this engine's KV layout (a decode request's remote layout must map onto it).
    """

    def __init__(self, instance: str, local_layout: KVLayout) -> None:
        self.instance, self.local_layout = instance, local_layout
        self.endpoints: tuple[str, ...] = ()
        self.ctx_layout: KVLayout | None = None
        self.packing = ""  # this engine's kernel packing digest (every worker's, they must agree)
        self._key = RequestKey.new()
        self._next = 1
        self._work = StepWork()
        self._seen: dict[str, tuple[RemotePrefill | None, str]] = {}  # decode req -> (parsed, refusal)
        self._local: dict[str, int] = {}  # decode req -> tokens its local prefix cache held when asked
        self._pulling: set[str] = set()
        self._loaded: set[str] = set()  # decode reqs whose pull ended (ok or not): never pulled again
        self._stats: dict[str, PullStats] = {}
        self._early: dict[str, _Early] = {}  # prefill req -> its early publish (router-minted handle)
        self._early_handles: set[int] = set()

    # --- set-up --------------------------------------------------------------------------------------
    def set_workers(self, endpoints: dict[int, str], layouts: dict[int, dict],
                    packings: dict[int, str] | None = None) -> None:
        """Every worker's control endpoint, layout wire form and packing digest, by kvbridge rank (from vLLM's
        handshake)."""
        world = self.local_layout.world_size
        if sorted(endpoints) != list(range(world)):
            raise ProtocolError(f"kvbridge workers reported ranks {sorted(endpoints)}; the engine has {world}")
        fps = {KVLayout.from_wire(w).fingerprint() for w in layouts.values()}
        if len(fps) != 1:
            raise ProtocolError(f"kvbridge workers disagree on the KV layout (fingerprints {sorted(fps)})")
        packs = set((packings or {}).values())
        if len(packs) > 1:
            raise ProtocolError(f"kvbridge workers disagree on the attention kernel's packing ({sorted(packs)})")
        # a decode-only engine's workers have no endpoint (no Sender): it publishes nothing
        self.endpoints = tuple(endpoints[r] for r in range(world)) if all(endpoints.values()) else ()
        self.ctx_layout = KVLayout.from_wire(layouts[0])
        self.packing = packs.pop() if packs else ""

    # --- decode side ---------------------------------------------------------------------------------
    def matched_tokens(self, req_id: str, params: Any, prompt: list[int], num_computed: int,
                       max_tokens: int | None = None) -> tuple[int, bool]:
        """vLLM's get_num_new_matched_tokens: tokens a remote prefill provides beyond the local prefix.

        Once per request: a request whose pull has ended and that vLLM schedules again (preempted for memory,
        its blocks freed) computes its prompt locally. The prefill engine let its blocks go when the pull
        confirmed, so a second pull could only fail the request (`RequestNotFound`)."""
        if req_id in self._loaded:
            return 0, False
        if req_id not in self._early and wants_remote_decode(params):
            self._early_of(req_id, params, prompt, max_tokens)
        if req_id not in self._seen:
            self._seen[req_id] = self._parse(params, prompt)
        remote, refusal = self._seen[req_id]
        if remote is None and not refusal:
            return 0, False
        self._local[req_id] = num_computed
        n = remote.num_tokens if remote is not None else len(prompt)
        count = n - num_computed
        return (count, True) if count > 0 else (0, False)

    def _parse(self, params: Any, prompt: list[int]) -> tuple[RemotePrefill | None, str]:
        try:
            remote = remote_prefill_of(params)
        except ProtocolError as e:
            return None, str(e)
        if remote is None:
            return None, ""
        if remote.num_tokens > len(prompt):
            return None, f"the remote prefill holds {remote.num_tokens} tokens, this request's prompt has {len(prompt)}"
        remote = remote.for_prompt(prompt_hash(prompt, remote.num_tokens or len(prompt)), len(prompt))
        n = remote.num_tokens  # <= len(prompt): checked above, and an early pull's whole prompt
        want = params[KEY].get("prompt_hash")
        if want is not None and want != prompt_hash(prompt, n):
            return None, ("this request's prompt is not the one the remote prefill computed (prompt_hash "
                          "differs): its KV would be another text's")
        ctx, mine = remote.disagg.ctx_layout, self.ctx_layout or self.local_layout
        target = self.local_layout
        if {ctx.order, mine.order} & PACKED_ORDERS:
            if ctx.order != mine.order:
                return None, (f"the prefill's KV cache is laid out {ctx.order}, this engine's {mine.order}: one "
                              f"packs each block its own way (vLLM's CPU attention), so both must use the same "
                              f"attention backend")
            # whole blocks move into a staging pool of the prefill's block size, repacked on the worker
            s = self.local_layout.shape
            target = KVLayout(KVShape(s.num_layers, s.num_kv_heads, s.head_dim, s.dtype,
                                      ctx.shape.tokens_per_block, s.mla), self.local_layout.split, mine.order)
        try:
            mapping_for(remote.disagg.ctx_layout, target)
        except Exception as e:  # noqa: BLE001 - any layout the formatter cannot map is refused by name
            return None, f"the prefill's KV layout cannot map onto this engine's: {e}"
        return remote, ""

    def after_alloc(self, req_id: str, block_ids: list[int], num_external_tokens: int) -> None:
        """vLLM's update_state_after_alloc: the blocks a load lands in are known; queue the pull or refusal."""
        if num_external_tokens <= 0 or req_id not in self._seen or req_id in self._pulling:
            return
        remote, refusal = self._seen[req_id]
        self._pulling.add(req_id)
        if remote is None:
            log.warning("kvbridge: request %s: kv_transfer_params refused: %s", req_id, refusal)
            self._work.refusals.append(Refuse(req_id, refusal))
            return
        self._work.pulls.append(Pull(req_id, remote.disagg.to_dict(), tuple(int(b) for b in block_ids),
                                     remote.num_tokens, self._local.get(req_id, 0), remote.packing))

    def worker_reports(self, stats: dict[str, PullStats], finished_recving) -> None:
        """vLLM's update_connector_output: pulls the workers finished (their stats merged over workers)."""
        for req_id, s in stats.items():
            self._stats[req_id] = self._stats[req_id].merge(s) if req_id in self._stats else s
        for req_id in finished_recving or ():
            if req_id in self._seen:  # still vLLM's (request_finished drops it: an aborted pull reports later)
                self._loaded.add(req_id)
            self._pulling.discard(req_id)
            self._seen.pop(req_id, None)
            self._local.pop(req_id, None)

    # --- both ----------------------------------------------------------------------------------------
    def request_finished(self, req_id: str, params: Any, prompt: list[int], num_computed: int,
                         finished_ok: bool, block_ids: list[int]) -> tuple[bool, dict | None]:
        """vLLM's request_finished: (keep the blocks for a decode instance, kv_transfer_params to answer)."""
        if req_id in self._pulling:  # aborted while its KV arrives: the workers cancel, vLLM frees on finish
            self._work.cancels.append(req_id)
        elif req_id not in self._loaded and req_id not in self._early:  # its pull never began: withdraw it
            remote = (self._seen.get(req_id) or self._parse(params, prompt))[0]
            if remote is not None and remote.num_tokens > 0:
                self._work.withdraws.append((remote.disagg.to_dict(), remote.num_tokens))
        self._seen.pop(req_id, None)
        self._local.pop(req_id, None)
        self._loaded.discard(req_id)
        stats = self._stats.pop(req_id, None)
        if req_id in self._early:
            return self._early_finished(req_id, finished_ok)
        if not wants_remote_decode(params):
            if stats is None:
                return False, None
            return False, {"kvbridge_transfer": {"bytes": stats.nbytes, "ms": round(stats.ms, 3),
                                                 "read_ms": round(stats.read_ms, 3), "error": stats.error,
                                                 "transport_ms": round(stats.transport_ms, 3),
                                                 "first_read_unix_ms": round(stats.first_read_unix_ms, 3)}}
        if not finished_ok or not block_ids or num_computed <= 0 or not self.endpoints:
            return False, None
        n = min(num_computed, len(prompt))
        rid, self._next = self._next, self._next + 1
        handle, secret = self._key.handle(rid), self._key.secret(rid)
        self._work.publishes.append(Publish(req_id, handle, secret, tuple(int(b) for b in block_ids), n))
        disagg = DisaggParams(handle, self.instance, self.endpoints, self.ctx_layout, secret)
        answer = prefill_answer(disagg, n)
        answer[KEY]["prompt_hash"] = prompt_hash(prompt, n)
        if self.packing:
            answer[KEY]["packing"] = self.packing
        return True, answer

    def take_work(self, scheduler_output: Any = None) -> StepWork:
        """vLLM's build_connector_meta: this step's work for every worker (and a fresh list for the next)."""
        if self._early and scheduler_output is not None:
            self._early_step(scheduler_output)
        work, self._work = self._work, StepWork()
        # no token scheduled: the engine only waits (for remote KV, or for nothing) and would spin through empty
        # steps; the workers may block a little for their pulls instead (connector.py, idle_wait_ms)
        work.idle = scheduler_output is not None and getattr(scheduler_output, "total_num_scheduled_tokens", 1) == 0
        return work

    # --- early decode (prefill side) -----------------------------------------------------------------
    def _early_of(self, req_id: str, params: Any, prompt: list[int], max_tokens: int | None) -> None:
        """Note a prefill request the router told its decode about before it ran (params.py: early decode)."""
        try:
            ep = early_publish_of(params)
        except ProtocolError as e:
            log.warning("kvbridge: request %s: %s; it publishes when it finishes instead", req_id, e)
            return
        if ep is None:
            return
        why = ("this engine publishes nothing (kv_role kv_consumer)" if not self.endpoints else
               f"it may generate {max_tokens} tokens (an early publish needs max_tokens 1: the blocks must "
               f"not move after the forward that writes them)" if max_tokens != 1 else
               f"handle {ep.handle} is already in use" if ep.handle in self._early_handles else "")
        if why:
            log.warning("kvbridge: request %s cannot publish early: %s; its decode's pull will fail", req_id, why)
            return
        n = len(prompt)
        self._early_handles.add(ep.handle)
        self._early[req_id] = _Early(EarlyPublish(ep.handle, bound_secret(ep.secret, prompt_hash(prompt, n))),
                                     ep.secret, n, prompt_hash(prompt, n))

    def _early_step(self, so: Any) -> None:
        """Follow the early requests' blocks through this step; publish those whose prompt completes in it."""
        for new in so.scheduled_new_reqs:
            st = self._early.get(new.req_id)
            if st is not None:
                st.blocks, st.computed = list(new.block_ids[0]), int(new.num_computed_tokens)
        c = so.scheduled_cached_reqs
        for i, req_id in enumerate(c.req_ids):
            st = self._early.get(req_id)
            if st is None:
                continue
            more = c.new_block_ids[i]
            if req_id in c.resumed_req_ids:
                st.blocks = list(more[0]) if more else []
            elif more:
                st.blocks += list(more[0])
            st.computed = int(c.num_computed_tokens[i])
        for req_id, st in self._early.items():
            steps = so.num_scheduled_tokens.get(req_id, 0)
            if st.published or not steps or st.computed + steps < st.n:
                continue
            st.published = True
            self._work.publishes.append(Publish(req_id, st.ep.handle, st.ep.secret, tuple(st.blocks), st.n,
                                                streamed=True))

    def _early_finished(self, req_id: str, finished_ok: bool) -> tuple[bool, dict | None]:
        st = self._early.pop(req_id)
        self._early_handles.discard(st.ep.handle)
        if not st.published:  # finished before its last chunk ran (aborted): nothing was published
            return False, None
        self._work.finished.append(req_id)
        if not finished_ok:
            self._work.send_cancels.append(req_id)
            return True, None
        disagg = DisaggParams(st.ep.handle, self.instance, self.endpoints, self.ctx_layout, st.raw_secret)
        answer = prefill_answer(disagg, st.n)
        answer[KEY].update(early=True, prompt_hash=st.prompt_hash)
        if self.packing:
            answer[KEY]["packing"] = self.packing
        return True, answer


class _Early:
    """An early prefill request: its handle and bound secret, the blocks vLLM gave it so far."""

    def __init__(self, ep: EarlyPublish, raw_secret: bytes, n: int, phash: str) -> None:
        self.ep, self.raw_secret, self.n, self.prompt_hash = ep, raw_secret, n, phash
        self.blocks: list[int] = []
        self.computed = 0
        self.published = False
