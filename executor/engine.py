"""The leader's scheduler: continuous batching over aggregated, context-only and generation-only requests.

Runs in rank 0 only. Each step it turns its request table into a STEP PLAN (plan.py: StepPlan, its ops and
BatchRows) that every rank executes identically (worker.py), then takes the sampled tokens back and moves
requests on. It never
touches tensors; block ids it reports are read from rank 0's KV cache manager, which every rank mirrors.

Who calls what, when (the transceiver's view; `Executor` in runtime.py is the in-process handle to it):

    context side (mode "context_only")
        submit(prompt, mode="context_only") -> request_id
        -> event Ctx (events.py): (request_id, block_ids, num_tokens, first_token) once the prefill ran, and in the next
           step every rank's hook gets on_context_done (hooks.py). The blocks stay PINNED on every rank:
           nothing frees or reuses them while the transceiver reads them.
        release(request_id)     after EVERY rank's transfer of the request finished (or failed): unpins
                                and frees the blocks on every rank. Exactly once per context request.
    generation side (mode "generation_only")
        submit(prompt, mode="generation_only", first_token=t, ctx_info={...}) -> request_id
        -> event GenAlloc: (request_id, block_ids) -- receive the prompt's KV into these blocks (the same
           ids on every rank, each rank holding its own heads/layers).
        kv_ready(request_id)    after every rank's KV arrived: the request starts decoding from t.
        Overlap (serving tells the generation side of a request while its prefill runs): submit it with
        first_token=None and ctx_info["first_token_later"]; it is allocated and pulls its KV at once, and
        starts decoding once both its KV is ready and join(request_id, t) gave its first token, whichever
        comes last (state awaiting_token between the two). An aborted one frees its blocks as usual.
        abort(request_id)       the transfer failed: the blocks are freed, the request ends ("aborted").
    both
        -> event Done: (request_id, tokens, reason) when an aggregated or generation-only
           request finishes; its blocks are freed in the next step.
        -> event Tok: (request_id, n, token) for a request submitted with stream=True, each time it has a
           new token and is still running (n = its tokens so far; the last one comes in Done).
        Logprobs (SamplingParams.logprobs >= 0): Ctx carries the first token's entry (lp), Tok its
        token's (lp), Done every entry sampled HERE (lps: a generation-only request's first token was
        sampled by the context side and has none here).

Sampling: each batch entry carries the request's SamplingParams and, when its penalties or min_tokens need
them, its TokenHistory (prompt, tokens so far, ids banned this step) -- the sampler keeps no state, so the
context side and an aggregated executor process a request's first token identically.

With a KV connector (connector/leader.py), an admitted request whose prompt prefix the connector holds is
allocated and waits ("loading") until every rank loaded it, then prefills the rest ("loaded"); a finished
request's blocks stay held while the connector saves them.

With block reuse (`match_prefix`, rank 0's KVCacheManager.match_prefix), an admitted request whose prompt
prefix is cached in full blocks starts on those blocks: a Reuse op (placed FIRST in the plan, before any op
that allocates and so could evict, so every rank finds what the leader saw) and a prefill of the rest only;
a generation-only request gets the same op and its transfer reads only the blocks after the reused ones
(the hook finds `reused_tokens` in ctx_info). The leader's reservations stay per request (shared blocks are
counted in every request holding them): pessimistic, so a running request never runs out of blocks.

Scheduling: FIFO admission while the pool can reserve every admitted request's blocks to completion (so a
running request never runs out of blocks) and the step's prefill token budget allows; a request that could
never fit is refused at once. New requests join between steps; all decoding requests step together.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from ..errors import ExecutorError
from ..transceiver.stats import TransferStats
from . import events as E
from . import plan as P
from .plan import BatchRow, StepPlan
from .request import MODES, Request, refusal

__all__ = ["Engine", "Request", "MODES"]


class Engine:
    """Leader-side request table and step planner.

    Args:
        num_blocks: blocks in every rank's pool.
        tokens_per_block: tokens per block.
        max_batch_tokens: prefill tokens admitted into one step (a longer prompt runs alone).
        max_batch_seqs: sequences in one step.
        max_position: longest sequence the model supports.
    """

    def __init__(self, num_blocks: int, tokens_per_block: int, *, max_batch_tokens: int = 2048,
                 max_batch_seqs: int = 64, max_position: int = 4096, vocab_size: int | None = None,
                 connector=None, hooked: bool = False, match_prefix=None) -> None:
        self.num_blocks, self.tpb = num_blocks, tokens_per_block
        self.max_batch_tokens, self.max_batch_seqs = max_batch_tokens, max_batch_seqs
        self.max_position = max_position
        self.vocab_size = vocab_size
        self.requests: dict[int, Request] = {}
        self.waiting: deque[int] = deque()
        self.reserved = 0
        self.step = 0
        self._ops: list = []                 # ops for the next plan, in order (plan.py)
        self._post_ops: list = []            # ops run after the step's forward (reads)
        self._events: list = []  # events.py, in order
        self.conn = connector  # the KV connector's leader side (connector/leader.py), or None
        self._held: dict[int, tuple[Any, int]] = {}  # rid -> (op, blocks): run when the connector is done
        # Rank hooks (the transceiver) may still move a request's KV when it is aborted: the abort reaches
        # every rank's hook (a HookAbort op), and the blocks are released only when every hook reported the
        # request settled (release / abort / kv_ready), never earlier.
        self.hooked = hooked
        self._hook_held: dict[int, tuple[Any, int]] = {}
        self.match_prefix = match_prefix  # (tokens, max_tokens) -> cached leading tokens; None: no reuse
        self._reuse_ops: list[P.Reuse] = []  # "reuse" ops of the next plan: they run before every other op
        self._started: list[E.Started] = []  # sent BEFORE the step runs (take_started), not after it

    # --- driver API (commands from the Executor handle) ------------------------------------------------
    def submit(self, req: Request) -> None:
        """Queue a request (its id chosen by the caller, unique). Refusals come back as Refused events."""
        if req.request_id in self.requests:
            self._refuse(req.request_id, f"request id {req.request_id} is already in use")
            return
        why = refusal(req, self.vocab_size, self.max_position)
        if why is not None:
            self._refuse(req.request_id, why)
            return
        total = len(req.prompt) + (req.max_tokens if req.mode != "context_only" else 1)
        req.reserved = self._blocks(total)
        if req.reserved > self.num_blocks:
            self._refuse(req.request_id, f"needs {req.reserved} KV blocks to completion, the pool has only "
                                         f"{self.num_blocks}; request refused")
            return
        self.requests[req.request_id] = req
        self.waiting.append(req.request_id)

    def kv_ready(self, request_id: int, stats: TransferStats | None = None) -> None:
        r = self._get(request_id, "kv_ready")
        if r is None:
            return
        if r.state != "awaiting_kv":
            self.error(request_id, f"kv_ready for request {request_id}, which is {r.state}, not awaiting KV")
            return
        self._ops.append(P.Ready(request_id))
        r.transfer, r.num_cached = stats, len(r.prompt)
        if r.first_token is None:  # overlap: its first token joins later
            r.state = "awaiting_token"
            return
        self._start_decoding(r)

    def join(self, request_id: int, first_token: int) -> None:
        """The first token of a generation-only request submitted without one. A request that ended meanwhile
        (its pull failed, it was aborted) is ignored: its Done already told why."""
        r = self.requests.get(request_id)
        if r is None:
            return
        if r.mode != "generation_only" or r.first_token is not None:
            self.error(request_id, f"join of request {request_id}: only a generation-only request submitted "
                                   f"without its first token takes one")
            return
        if self.vocab_size is not None and not 0 <= first_token < self.vocab_size:
            self.abort(request_id, f"first token {first_token} is outside the model's vocabulary "
                                   f"0..{self.vocab_size - 1}")
            return
        r.first_token = int(first_token)
        if r.state == "awaiting_token":
            self._start_decoding(r)

    def _start_decoding(self, r: Request) -> None:
        r.state, r.output, r.decode_at = "running", [int(r.first_token)], time.time()
        self._check_finished(r)
        self._stream(r)

    def release(self, request_id: int) -> None:
        r = self._get(request_id, "release")
        if r is None:
            return
        if r.state != "ctx_done":
            self.error(request_id, f"release of request {request_id}, which is {r.state}; only a finished "
                                    f"context-only request is released")
            return
        self._finish(r, P.Release(request_id))
        self._drop(r, "released")
        self._events.append(E.Released(request_id))

    def abort(self, request_id: int, error: str = "") -> None:
        r = self._get(request_id, "abort")
        if r is None:
            return
        if r.state == "waiting":
            self.waiting.remove(request_id)
            self.requests.pop(request_id)
        elif r.state in ("ctx_done", "awaiting_kv") and self.hooked:  # a transfer may be moving its KV now
            self._ops.append(P.HookAbort(request_id))
            then = P.Release(request_id) if r.state == "ctx_done" else P.Free(request_id)
            self._hook_held[request_id] = (then, r.reserved)
            self._drop(r, "aborted")
            self.reserved += r.reserved  # the blocks stay taken until every rank's hook settled
        elif r.state == "ctx_done":
            self._ops.append(P.Release(request_id))
            self._drop(r, "aborted")
        elif r.state == "loading":  # the connector may still write into its blocks: free them once it ended
            self._hold(r, P.Free(request_id))
            self._drop(r, "aborted")
        else:
            self._ops.append(P.Free(request_id))
            self._drop(r, "aborted")
        self._events.append(E.Done(request_id, list(r.output), "aborted", error))

    def io(self, kind: str, request_id: int) -> bool:
        """Queue a KV read ("read": after the next step) or write ("write": before it) of a live request.

        Returns False (and reports a ReqError) when the request holds no blocks.
        """
        r = self._get(request_id, kind)
        if r is None:
            return False
        if r.state in ("waiting", "finished"):
            self.error(request_id, f"{kind} of request {request_id}, which holds no blocks ({r.state})")
            return False
        if kind == "read":
            self._post_ops.append(P.Read(request_id))
        else:
            self._ops.append(P.Write(request_id))
        return True

    # --- the step -----------------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self._ops or self._post_ops or self.waiting
                    or any(r.state in ("running", "loaded") for r in self.requests.values())
                    or (self.conn is not None and self.conn.has_work()))

    def next_plan(self) -> StepPlan:
        """The next step's plan: ops, then the batch (admitted prefills, one decode per running request)."""
        batch: list[BatchRow] = []
        budget = self.max_batch_tokens
        for r in self.requests.values():
            if r.state == "running" and len(batch) < self.max_batch_seqs:
                batch.append(r.row(r.num_cached, [r.output[-1]]))
            elif r.state == "loaded" and len(batch) < self.max_batch_seqs:  # its prefix is loaded: the rest
                budget -= len(r.prompt) - r.num_cached
                batch.append(r.row(r.num_cached, list(r.prompt[r.num_cached:])))
                r.state = "prefill"
        while self.waiting and len(batch) < self.max_batch_seqs:
            r = self.requests[self.waiting[0]]
            if self.reserved + r.reserved > self.num_blocks:
                break
            if r.mode != "generation_only":
                if len(r.prompt) > budget and budget != self.max_batch_tokens:
                    break
                r.reused = self._reuse(r)
                n = self.conn.admit(r) if self.conn is not None and not r.reused else 0
                if n:  # the connector loads the first n prompt tokens into its blocks first
                    self._ops.append(P.ConnAlloc(r.request_id, len(r.prompt),
                                                 list(r.prompt[:n]) if self.match_prefix is not None else None))
                    r.state, r.num_cached, r.loaded = "loading", n, n
                else:
                    budget -= len(r.prompt) - r.reused
                    batch.append(r.row(r.reused, list(r.prompt[r.reused:])))
                    r.state = "prefill"
                if r.mode == "context_only" and r.ctx_info.get("notify_start"):
                    self._started.append(E.Started(r.request_id, time.time()))
            else:  # (reuse needs the rank hooks: they read only the blocks after the reused ones)
                r.reused = self._reuse(r) if self.hooked else 0
                self._ops.append(P.Xfer(r.request_id, len(r.prompt), r.ctx_info, r.reused,
                                        list(r.prompt) if self.match_prefix is not None else None))
                r.state = "awaiting_kv"
                self._events.append(E.GenAlloc(r.request_id))
            self.waiting.popleft()
            self.reserved += r.reserved
        self.step += 1
        plan = StepPlan(self.step, False, tuple(self._reuse_ops + self._ops), tuple(batch), tuple(self._post_ops),
                        conn=self.conn.plan_section(batch) if self.conn is not None else None)
        self._ops, self._post_ops, self._reuse_ops = [], [], []
        return plan

    def step_done(self, plan: StepPlan, sampled: list[int], logprobs: list | None = None) -> list:
        """Take the step's sampled tokens (one per batch entry, in order) and their logprob entries
        (TokenLogprob or None per entry), and return the events to report (events.py)."""
        if len(sampled) != len(plan.batch):
            raise ExecutorError(f"step {plan.step}: {len(sampled)} sampled tokens for {len(plan.batch)} "
                                f"sequences")
        logprobs = logprobs or [None] * len(sampled)
        for row, tok, lp in zip(plan.batch, sampled, logprobs):
            rid, start, toks = row.rid, row.start, row.tokens
            r = self.requests[rid]
            r.num_cached = start + len(toks)
            r.output.append(int(tok))
            if lp is not None:
                r.logprobs.append(lp)
            if r.state == "prefill" and r.mode == "context_only":
                r.state = "ctx_done"
                self._ops.append(P.CtxDone(rid, int(tok)))  # tells every rank's hook, first token included
                self._events.append(E.Ctx(rid, int(tok), r.num_cached, lp=lp, loaded=r.loaded, reused=r.reused,
                                          t_end=time.time()))
                continue
            r.state = "running"
            self._check_finished(r)
            self._stream(r)
        ev, self._events = self._events, []
        return ev

    # --- internals ----------------------------------------------------------------------------------------
    def _check_finished(self, r: Request) -> None:
        reason = None
        stops = r.output and not r.sampling.ignore_eos and len(r.output) >= r.sampling.min_tokens
        if stops and r.output[-1] in r.stop_ids:
            reason = "stop"
        elif len(r.output) >= r.max_tokens:
            reason = "length"
        if reason:
            self._finish(r, P.Free(r.request_id))
            self._drop(r, reason)
            self._events.append(E.Done(r.request_id, list(r.output), reason, "", r.transfer, r.loaded, r.reused,
                                       tuple(r.logprobs), r.decode_at))

    def _stream(self, r: Request) -> None:
        """A streaming request still running: report its newest token (n = tokens so far)."""
        if r.stream and r.state == "running":
            lp = None
            if r.logprobs and len(r.logprobs) == len(r.output) - (r.mode == "generation_only"):
                lp = r.logprobs[-1]  # the newest token was sampled here, with logprobs
            self._events.append(E.Tok(r.request_id, len(r.output), r.output[-1], lp))

    # --- the KV connector (connector/leader.py) -------------------------------------------------------------
    def _finish(self, r: Request, op: Any) -> None:
        """Free a finished request's blocks in the next step, or once the connector has saved them."""
        if self.conn is not None and self.conn.request_finished(r):
            self._hold(r, op)
        else:
            self._ops.append(op)

    def _hold(self, r: Request, op: Any) -> None:
        self._held[r.request_id] = (op, r.reserved)
        self.reserved += r.reserved  # _drop gives the reservation back: the blocks stay taken until `op`

    def hook_settled(self, request_id: int) -> bool:
        """Every rank's hook reported on `request_id`: True if it was aborted earlier and its blocks can go now."""
        op, blocks = self._hook_held.pop(request_id, (None, 0))
        if op is None:
            return False
        self._ops.append(op)
        self.reserved -= blocks
        return True

    def connector_done(self, saved: list[int], loaded: list[tuple[int, str]]) -> None:
        """Saves and loads that ended on every rank: free held blocks, start loaded requests' prefills."""
        for rid in saved + [rid for rid, _ in loaded if rid in self._held]:
            op, blocks = self._held.pop(rid, (None, 0))
            if op is not None:
                self._ops.append(op)
                self.reserved -= blocks
        for rid, err in loaded:
            r = self.requests.get(rid)
            if r is None or r.state != "loading":
                continue
            if err:  # some rank could not load: compute the whole prompt (every rank's load has ended)
                r.num_cached = r.loaded = 0
            self._ops.append(P.Ready(rid))
            r.state = "loaded"

    def _drop(self, r: Request, reason: str) -> None:
        r.state, r.finish_reason = "finished", reason
        self.reserved -= r.reserved
        self.requests.pop(r.request_id, None)

    def _reuse(self, r: Request) -> int:
        """Leading prompt tokens of `r` cached in full blocks, short of the last prompt token (computed on the
        context side, the first one pulled on the generation side); queues its "reuse" op."""
        if self.match_prefix is None:
            return 0
        n = int(self.match_prefix(r.prompt, len(r.prompt) - 1))
        if n:
            self._reuse_ops.append(P.Reuse(r.request_id, list(r.prompt), n))
        return n

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.tpb)

    def _get(self, request_id: int, what: str) -> Request | None:
        r = self.requests.get(request_id)
        if r is None:
            self.error(request_id,
                        f"{what}: unknown request {request_id} (never submitted, finished, or released)")
        return r

    def _refuse(self, rid: int, msg: str) -> None:
        self._events.append(E.Refused(rid, msg))

    def error(self, rid: int, msg: str) -> None:
        """Report that a call about request `rid` was not allowed (a ReqError event; the request, if any,
        goes on)."""
        self._events.append(E.ReqError(rid, msg))

    def take_started(self) -> list:
        """Started events of the plan just made: the leader sends them before it runs the step (the prefill
        they announce takes the whole step; with stream_layers its layers become readable during it)."""
        ev, self._started = self._started, []
        return ev

    def take_events(self) -> list:
        ev, self._events = self._events, []
        return ev
