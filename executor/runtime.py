"""`Executor`: the in-process handle to a reference executor of N rank processes (TP x PP).

Owns the rank processes (spawned, one per rank; rank 0 leads) and the parent's side of their pipes: it sends
commands to the leader and collects events, KV shards and errors from every rank (rank_replies.py: the
reader threads, the reply state and the bounded waits). Every wait has a deadline;
a rank that dies or reports an error makes every pending and later call raise ExecutorError naming it.

The API (see engine.py for when each call is allowed):
    ex = Executor.start(ExecutorConfig(model="seeded:tiny", tp=2))
    ex.generate([[1, 2, 3]], max_tokens=8) -> [[...tokens...]]                  aggregated
    res = ex.prefill(prompt) -> ContextResult(request_id, block_ids, num_tokens, first_token)   context-only
    ex.read_kv(res.request_id) -> [layers, 2, kv_heads, tokens, head_dim] tensor (whole model, CPU)
    ex.kv_digest(rid) -> KVDigest: per (layer, kv head) digests in token order (kv_check.py; kv_digests=True)
    ex.release(res.request_id)                                                   blocks unpinned and freed
    g = ex.add_generation(prompt, first_token, max_tokens) -> GenerationHandle(request_id, block_ids)
    ex.write_kv(g.request_id, kv); ex.kv_ready(g.request_id); ex.wait(g.request_id) -> Completion
    ex.free_blocks() -> free blocks per rank (all back to num_blocks when idle); ex.close()
    rid = ex.submit(prompt, stream=True); ex.wait_tokens(rid, have, timeout) -> (tokens, Completion | None)
    ex.wait_stream(rid, have, timeout) -> (tokens, logprobs, Completion | None)   (SamplingParams.logprobs)
    ex.take_released() -> context requests released since the last call (by the hook; not mixed with release)
    ExecutorConfig(enable_block_reuse=True): prompts' cached prefixes are not computed (or pulled) again;
        Completion / ContextResult.reused_tokens say how many; free_blocks counts evictable cached blocks.
"""

from __future__ import annotations

import itertools
import threading
import time

import torch

from .. import codec
from ..errors import ExecutorError
from ..formatter.layout import KVLayout
from ..kvcache.manager import TORCH_DTYPES
from .config import ModelConfig
from .connector.factory import connector_wire
from .kv_check import KVDigest, merge
from .kv_io import assemble, shard_of
from .launch import rendezvous_store, spawn_ranks, stop_processes
from .sampling import SamplingParams, TokenLogprob
from .results import Completion, ContextResult, ExecutorConfig, GenerationHandle
from . import events as E
from . import pipe_messages as pm
from .pipes import Pipes
from .rank_replies import RankReplies, raise_refusal
from .worker import rank_main

__all__ = ["ExecutorConfig", "Executor", "ContextResult", "GenerationHandle", "Completion"]


class Executor(RankReplies):
    """Handle to running rank processes. Create with `Executor.start(config)`; close with `close()`."""

    def __init__(self, cfg: ExecutorConfig) -> None:
        self.cfg = cfg
        super().__init__()
        self._ids = itertools.count(1)
        self.model_config: ModelConfig | None = None
        self.layout: KVLayout | None = None
        self._store = None  # the ranks' rendezvous (world > 1): a FileStore in a private folder

    # --- lifecycle ---------------------------------------------------------------------------------------
    @classmethod
    def start(cls, cfg: ExecutorConfig) -> "Executor":
        """Spawn the ranks and wait (up to cfg.timeout_s) until every one has loaded and joined the groups."""
        ex = cls(cfg)
        world = cfg.tp * cfg.pp
        ex._store = rendezvous_store() if world > 1 else None  # lives as long as the executor
        blob = codec.pack({
            "model": cfg.model, "tp": cfg.tp, "pp": cfg.pp,
            "layers_per_stage": list(cfg.layers_per_stage) if cfg.layers_per_stage else None,
            "num_blocks": cfg.num_blocks, "tokens_per_block": cfg.tokens_per_block, "device": cfg.device,
            "dtype": cfg.resolved_dtype(), "max_batch_tokens": cfg.max_batch_tokens,
            "max_batch_seqs": cfg.max_batch_seqs, "timeout_s": cfg.timeout_s,
            "threads_per_rank": cfg.threads_per_rank, "store": ex._store.path if ex._store else "",
            "rank_hook": cfg.rank_hook, "rank_hook_args": cfg.rank_hook_args,
            "kv_connector": connector_wire(cfg.kv_connector_config), "kv_digests": bool(cfg.kv_digests),
            "enable_block_reuse": bool(cfg.enable_block_reuse), "stream_layers": int(cfg.stream_layers),
            "kv_events": dict(cfg.kv_events) if cfg.kv_events else None,
        })
        ex._procs, to_rank, from_rank = spawn_ranks(world, rank_main, lambda r: (blob,))
        ex._pipes = [Pipes(rx, tx, pm.decode_reply) for rx, tx in zip(from_rank, to_rank)]
        ex._readers = [threading.Thread(target=ex._read_loop, args=(r,), daemon=True, name=f"kvbridge-rx{r}")
                       for r in range(world)]
        for t in ex._readers:
            t.start()
        try:
            ex._wait_for(lambda st: len(st.ready) == world or None, cfg.timeout_s, "the ranks to start")
        except BaseException:
            ex.close()
            raise
        first = ex._st.ready[0]
        ex.model_config = ModelConfig.from_dict(first.config)
        ex.layout = KVLayout.from_wire(first.layout)
        return ex

    def close(self, timeout: float = 10.0) -> None:
        """Stop every rank (leader first, the others follow its stop plan), then reap the processes."""
        if self._closing:
            return
        self._closing = True
        try:
            self._pipes[0].send(pm.Stop())
        except (OSError, ValueError):
            pass
        stop_processes(self._procs, timeout)
        if self._store is not None:
            self._store.close()
            self._store = None

    @property
    def error(self) -> str | None:
        """Why this executor can no longer serve (a rank died or failed, or it was closed); None while healthy."""
        return self._st.fatal or ("the executor is closed" if self._closing else None)

    def __enter__(self) -> "Executor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- requests ----------------------------------------------------------------------------------------
    def submit(self, prompt: list[int], *, max_tokens: int = 16, mode: str = "aggregated",
               sampling: SamplingParams | None = None, stop_ids: tuple[int, ...] | None = None,
               first_token: int | None = None, ctx_info: dict | None = None,
               request_id: int | None = None, stream: bool = False) -> int:
        """Queue a request; returns its id. stop_ids defaults to the model's EOS tokens.

        stream=True: its tokens can be followed with `wait_tokens` while it runs. An explicit request_id
        still in use (not yet done, refused or released) raises ExecutorError here, before anything is sent.
        """
        with self._cv:  # a duplicate is refused here: the engine's refusal would reach the first one's waiter
            rid = next(self._ids) if request_id is None else int(request_id)
            while request_id is None and rid in self._live:
                rid = next(self._ids)
            if rid in self._live:
                raise ExecutorError(f"request id {rid} is already in use")
            self._live.add(rid)
        stops = self.model_config.eos_token_ids if stop_ids is None else tuple(stop_ids)  # also what
        # min_tokens bans (a context-only request never stops on them, but bans them for its first token)
        self._send(pm.Add(rid, [int(t) for t in prompt], int(max_tokens), str(mode), sampling or SamplingParams(),
                          [int(t) for t in stops], None if first_token is None else int(first_token),
                          dict(ctx_info or {}), bool(stream)))
        return rid

    def wait(self, request_id: int, timeout: float | None = None) -> Completion:
        """Wait for an aggregated or generation-only request to finish."""
        ev = self._wait_event((E.Done, request_id), timeout, f"request {request_id} to finish")
        return self._completion(request_id, ev)

    def wait_tokens(self, request_id: int, have: int, timeout: float) -> tuple[list[int], Completion | None]:
        """Wait up to `timeout` for a request to have more than `have` tokens, or to finish.

        Args:
            request_id: an aggregated or generation-only request (submitted with stream=True to see tokens
                before it finishes).
            have: how many of its tokens the caller has already seen.
            timeout: seconds; returning with nothing new is not an error.
        Returns:
            (its tokens so far, its Completion once finished, else None).
        Raises:
            ExecutorError / KVCacheExhausted: the request was refused or the executor failed.
        """
        toks, _lps, done = self.wait_stream(request_id, have, timeout)
        return toks, done

    def wait_stream(self, request_id: int, have: int, timeout: float
                    ) -> tuple[list[int], list[TokenLogprob], Completion | None]:
        """`wait_tokens`, with the logprob entries of the tokens so far (those sampled here, when asked for;
        taken with the tokens, so they always match them)."""
        keys = ((E.Done, request_id), (E.Refused, request_id), (E.ReqError, request_id))
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                ev = next((self._st.events.pop(k) for k in keys if k in self._st.events), None)
                if ev is not None:
                    break
                toks = self._st.partial.get(request_id, ())
                left = deadline - time.monotonic()
                if len(toks) > have or left <= 0:
                    return list(toks), list(self._st.partial_lp.get(request_id, ())), None
                if self._st.fatal:
                    raise ExecutorError(f"while waiting for request {request_id}: {self._st.fatal}")
                self._cv.wait(min(left, 0.5))
        raise_refusal(ev)
        c = self._completion(request_id, ev)
        return c.tokens, list(c.logprobs), c

    def take_released(self) -> list[int]:
        """Context-only requests released since the last call (by the rank hooks). A server calls it now and
        then so the release events do not pile up; do not call it while a `release` call waits."""
        with self._cv:
            ids = [rid for (t, rid) in self._st.events if t is E.Released]
            for rid in ids:
                del self._st.events[(E.Released, rid)]
        return ids

    def _completion(self, request_id: int, ev: E.Done) -> Completion:
        with self._cv:  # a finished request leaves nothing behind
            self._st.partial.pop(request_id, None)
            self._st.partial_lp.pop(request_id, None)
            self._st.events.pop((E.GenAlloc, request_id), None)
        return Completion(request_id, list(ev.tokens), ev.reason, ev.error, ev.transfer, ev.loaded, ev.reused,
                          tuple(ev.lps), ev.t_decode)

    def generate(self, prompts: list[list[int]], *, max_tokens: int = 16,
                 sampling: SamplingParams | None = None,
                 stop_ids: tuple[int, ...] | None = None, timeout: float | None = None) -> list[list[int]]:
        """Aggregated mode: submit every prompt at once (batched together) and return each one's tokens."""
        rids = [self.submit(p, max_tokens=max_tokens, sampling=sampling, stop_ids=stop_ids) for p in prompts]
        return [self.wait(r, timeout).tokens for r in rids]

    def prefill(self, prompt: list[int], *, sampling: SamplingParams | None = None,
                timeout: float | None = None, request_id: int | None = None,
                stop_ids: tuple[int, ...] | None = None) -> ContextResult:
        """Context-only: prefill `prompt`, sample its first token; the KV stays pinned until `release`.

        stop_ids (default the model's EOS tokens) never end a context-only request; sampling.min_tokens
        bans them for the first token, as the generation side's (or an aggregated executor's) would.
        """
        rid = self.submit(prompt, max_tokens=1, mode="context_only", sampling=sampling, request_id=request_id,
                          stop_ids=stop_ids)
        return self.wait_context(rid, timeout)

    def wait_context(self, request_id: int, timeout: float | None = None) -> ContextResult:
        """Wait for the prefill of a context-only request submitted with `submit(..., mode="context_only")`
        (with stream_layers its KV is readable layer by layer before this returns)."""
        rid = request_id
        ev = self._wait_event((E.Ctx, rid), timeout, f"the prefill of request {rid}")
        return ContextResult(rid, tuple(ev.block_ids), ev.num_tokens, ev.first_token, ev.reused, ev.lp, ev.t_end)

    def wait_started(self, request_id: int, timeout: float | None = None) -> float:
        """Wait until a context-only request submitted with ctx_info {"notify_start": True} was admitted into
        the step that prefills it (with stream_layers it is published then); returns that unix time."""
        return self._wait_event((E.Started, request_id), timeout, f"the prefill of request {request_id} to "
                                                                  f"start").t

    def join(self, request_id: int, first_token: int) -> None:
        """The first token of a generation-only request submitted with first_token=None and ctx_info
        {"first_token_later": True}: it decodes once its KV is in too (engine.py: overlap)."""
        self._send(pm.Join(int(request_id), int(first_token)))

    def release(self, request_id: int, timeout: float | None = None) -> None:
        """Unpin and free a context-only request's blocks on every rank (after its transfers finished)."""
        self._send(pm.Release(int(request_id)))
        self._wait_event((E.Released, request_id), timeout, f"the release of request {request_id}")

    def wait_released(self, request_id: int, timeout: float | None = None) -> None:
        """Wait until the rank hooks released context-only request `request_id` (its transfers ended, or it
        was aborted and every rank settled it); do not mix with `take_released`."""
        self._wait_event((E.Released, request_id), timeout, f"the release of request {request_id}")

    def add_generation(self, prompt: list[int], first_token: int, *, max_tokens: int = 16,
                       sampling: SamplingParams | None = None, stop_ids: tuple[int, ...] | None = None,
                       ctx_info: dict | None = None, timeout: float | None = None,
                       request_id: int | None = None) -> GenerationHandle:
        """Generation-only: allocate blocks for `prompt`'s KV (to be received), return their ids."""
        rid = self.submit(prompt, max_tokens=max_tokens, mode="generation_only", sampling=sampling,
                          stop_ids=stop_ids, first_token=int(first_token), ctx_info=ctx_info,
                          request_id=request_id)
        ev = self._wait_event((E.GenAlloc, rid), timeout, f"the blocks of request {rid}")
        return GenerationHandle(rid, tuple(ev.block_ids))

    def kv_ready(self, request_id: int) -> None:
        """The prompt KV of a generation-only request is in place on every rank: start decoding."""
        self._send(pm.KvReady(int(request_id)))

    def abort(self, request_id: int) -> None:
        """End a request now (a failed transfer, a client gone); its blocks are freed."""
        self._send(pm.Abort(int(request_id)))

    # --- KV in and out -------------------------------------------------------------------------------------
    def read_kv(self, request_id: int, timeout: float | None = None) -> torch.Tensor:
        """The request's whole KV, assembled from every rank: [layers, kv_factor, kv_heads, tokens, head_dim].

        Replicated kv heads (TP above the kv head count) are checked equal on every rank holding them.
        """
        lay = self.layout
        self._send(pm.ReadKv(int(request_id)))
        world = lay.world_size

        def pred(st):
            if (E.ReqError, request_id) in st.events:
                return st.events.pop((E.ReqError, request_id))
            return all((request_id, r) in st.kv for r in range(world)) or None

        got = self._wait_for(pred, timeout or self.cfg.timeout_s, f"the KV of request {request_id}")
        if isinstance(got, E.ReqError):
            raise ExecutorError(got.msg)
        with self._cv:
            shards = {r: self._st.kv.pop((request_id, r)) for r in range(world)}
        try:
            return assemble(lay, shards)
        except ExecutorError as e:
            raise ExecutorError(f"read_kv of request {request_id}: {e}") from None

    def write_kv(self, request_id: int, kv: torch.Tensor) -> None:
        """Write a generation-only request's prompt KV ([layers, kv_factor, kv_heads, tokens, head_dim]) into
        its blocks on every rank, each rank getting its layers and heads. Takes effect before the next
        step."""
        lay = self.layout
        dt = TORCH_DTYPES[lay.shape.dtype]
        kv = kv.to(dt).cpu()
        for r in range(lay.world_size):
            x = shard_of(lay, r, kv)
            self._pipes[r].send(pm.KvShard(int(request_id), list(x.shape), lay.shape.dtype),
                                x.view(torch.uint8).numpy().tobytes())
        self._send(pm.WriteKv(int(request_id)))

    def kv_digest(self, request_id: int, timeout: float | None = None) -> KVDigest:
        """The request's positional KV digest, merged from every rank (kv_check.py): the one recorded when its
        prefill was done (context-only) or its KV was ready (generation-only), taken once; else, for a live
        request, its KV now. Raises ExecutorError when a rank has none (e.g. kv_digests off)."""
        world = self.layout.world_size
        self._send(pm.QueryDigest(int(request_id)))
        self._wait_for(lambda st: all((request_id, r) in st.digests for r in range(world)) or None,
                       timeout or self.cfg.timeout_s, f"the KV digest of request {request_id}")
        with self._cv:
            shards = {r: self._st.digests.pop((request_id, r)) for r in range(world)}
        return merge(self.layout, shards)

    def free_blocks(self, timeout: float | None = None) -> list[int]:
        """Free blocks on every rank, in rank order (taken between two steps)."""
        with self._cv:
            self._st.stats.clear()
        self._send(pm.QueryStats())
        world = self.layout.world_size
        self._wait_for(lambda st: len(st.stats) == world or None, timeout or self.cfg.timeout_s,
                       "block counts")
        return [self._st.stats[r].free for r in range(world)]
