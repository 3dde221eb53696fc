"""One rank process: loads its shard, builds its pool, and runs step plans in lockstep with the other ranks.

Rank 0 is the leader: it reads commands from the parent (`Executor`), plans each step with the `Engine`,
broadcasts the plan (plan.py's StepPlan as msgpack bytes in a tensor), runs it like every other rank, and
reports events (leader.py). Other
ranks only run plans. Every rank talks to the parent over its own pair of pipes with msgpack frames (never
pickle): KV shards for `read_kv`/`write_kv`, KV digests (`kv_check.py`), its readiness, and its fatal error
(then it exits non-zero).

Never frees a block except as a plan says, so every rank's allocator stays identical to the leader's; the
plan carries the leader's free-block count before its ops and each rank checks it.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

import torch

from .. import codec
from ..errors import ExecutorError
from ..formatter.layout import ParallelSplit
from ..gcheap import freeze_startup_heap
from ..kvcache.manager import TORCH_DTYPES, KVCacheManager
from .comm import Comm
from .config import kv_layout_for
from . import pipe_messages as pm
from . import plan as P
from .plan import BatchRow, StepPlan
from .hooks import HookReport, RankContext, exchange_reports, load_hook, validate_report
from .kv_check import DigestBook
from .kv_io import gather_blocks, scatter_blocks
from .leader import leader_loop
from .model import StageModel, StepBatch
from .pipes import Inbox, Pipes
from .sampling import logprob_width, pack_logprobs, sample_step, unpack_logprobs
from .sources import load_source
from .streaming import LayerStreamer, supports_streaming
from .weights import stage_weights

__all__ = ["rank_main"]

MAX_FRAME = 1 << 31


class _Runner:
    """Executes plans on one rank."""

    def __init__(self, cfg: dict, rank: int, pipes: Pipes, inbox: Inbox) -> None:
        self.rank, self.pipes, self.inbox = rank, pipes, inbox
        self.timeout = float(cfg["timeout_s"])
        dev = cfg["device"]
        if dev.startswith("cuda"):  # "cuda": rank r on GPU r; "cuda:N": rank r on GPU N + r (mod the count)
            base = int(dev.split(":", 1)[1]) if ":" in dev else 0
            dev = f"cuda:{(base + rank) % max(1, torch.cuda.device_count())}"
        self.device = torch.device(dev)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        src = load_source(cfg["model"])
        self.mcfg = src.config
        split = ParallelSplit(cfg["tp"], cfg["pp"], tuple(cfg["layers_per_stage"]) if cfg["layers_per_stage"]
                              else None)
        self.layout = kv_layout_for(self.mcfg, split, cfg["dtype"], cfg["tokens_per_block"])
        self.kv = KVCacheManager(self.layout, rank, cfg["num_blocks"], device=self.device,
                                 enable_block_reuse=bool(cfg.get("enable_block_reuse", False)),
                                 model_id=str(cfg["model"]))
        self.comm = Comm(self.layout, rank, cfg["store"], self.device, self.timeout)
        w = stage_weights(src, self.layout, rank, device=self.device, dtype=TORCH_DTYPES[cfg["dtype"]])
        del src
        self.model = StageModel(self.mcfg, self.layout, rank, w, self.kv, self.comm.all_reduce_tp)
        self.tp_rank, self.pp_rank = self.layout.coords(rank)
        self.sampler_rank = self.layout.rank_of(0, self.layout.split.pp - 1)
        self.digests = DigestBook(self.layout, rank)  # positional KV check (kv_check.py): reports any time,
        self.record_digests = bool(cfg.get("kv_digests"))  # records at ctx_done / ready only when asked
        self.hook = None
        if cfg.get("rank_hook"):
            self.hook = load_hook(cfg["rank_hook"], RankContext(rank, self.layout, self.kv, self.device,
                                                                self.mcfg,
                                                                dict(cfg.get("rank_hook_args") or {})))
        self.conn = None  # the KV connector's worker half (connector/rank.py); the model calls its hooks
        if cfg.get("kv_connector"):
            from .connector.rank import ConnectorRank

            self.conn = ConnectorRank(cfg, rank, self.layout, self.kv.pool, self.device, self.mcfg.to_dict())
            self.model.kv_connector = self.conn
        self.streamer = None  # layer-wise streaming of context-only prefills (streaming.py)
        if int(cfg.get("stream_layers") or 0) > 0 and supports_streaming(self.hook):
            self.streamer = LayerStreamer(self.hook, int(cfg["stream_layers"]), len(self.model.layers),
                                          self.device)

    def exchange(self) -> list[HookReport] | None:
        """After a step: every rank's hook report, gathered on every rank (None without hooks)."""
        if self.hook is None:
            return None
        return exchange_reports(self.comm, validate_report(self.hook.poll(), self.rank))

    def exchange_connector(self) -> list[dict] | None:
        """After a step: every rank's connector report (get_finished), on every rank (None without one)."""
        return None if self.conn is None else self.conn.exchange(self.comm)

    # --- one plan -------------------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> tuple[list[int], list] | None:
        """Run one plan; on rank 0 returns (sampled tokens, TokenLogprob entries or None), one per row."""
        kv = self.kv
        if plan.free_before >= 0 and plan.free_before != kv.get_num_free_blocks():
            raise ExecutorError(f"rank {self.rank}: {kv.get_num_free_blocks()} free blocks before step "
                                f"{plan.step}, the leader has {plan.free_before}: allocators diverged")
        for op in plan.ops:
            self._OPS[type(op)](self, op)  # (the plan decoded only known kinds: plan.OPS)
        if self.conn is not None and plan.conn is not None:
            self.conn.begin_step(plan.conn)  # bind_connector_meta + start_load_kv
        sampled = self._run_batch(plan.batch) if plan.batch else None
        if self.conn is not None and plan.conn is not None:
            self.conn.end_step()  # wait_for_save
        for op in plan.post:
            self._POST[type(op)](self, op)
        return sampled

    # --- plan ops (before the forward pass), one method each ---------------------------------------------
    def _op_free(self, op: P.Free) -> None:
        self.kv.free_resources(op.rid)

    def _op_reuse(self, op: P.Reuse) -> None:  # the request starts on the cached blocks of its prefix
        self.kv.add_sequence_reusing(op.rid, [int(t) for t in op.prompt], op.n)

    def _op_xfer(self, op: P.Xfer) -> None:  # a generation-only request: blocks for its pulled KV
        blocks = self.kv.add_sequence_for_transfer(op.rid, op.prompt_len, op.prompt, op.reused)
        if self.hook is not None:
            info = dict(op.ctx_info)
            info["reused_tokens"] = op.reused  # set here, never taken from the client's ctx_info
            self.hook.on_generation_alloc(op.rid, blocks, op.prompt_len, info)

    def _op_ready(self, op: P.Ready) -> None:
        self.kv.mark_ready(op.rid)
        if self.record_digests:  # the prompt KV just arrived: hash it before decoding appends
            self.digests.record(op.rid, self.kv)

    def _op_conn_alloc(self, op: P.ConnAlloc) -> None:  # blocks the KV connector loads a stored prefix into
        self.kv.add_sequence_for_transfer(op.rid, op.prompt_len, op.prefix)

    def _op_release(self, op: P.Release) -> None:
        self.kv.free_resources(op.rid)
        self.kv.unpin(op.rid)

    def _op_write(self, op: P.Write) -> None:
        self._write_kv(op.rid)

    def _op_hook_abort(self, op: P.HookAbort) -> None:  # aborted: its transfer must stop before blocks go
        if self.hook is not None and hasattr(self.hook, "on_abort"):
            self.hook.on_abort(op.rid)

    def _op_ctx_done(self, op: P.CtxDone) -> None:  # the previous step's context-only prefill is done
        kv, rid = self.kv, op.rid
        if self.record_digests:
            self.digests.record(rid, kv)
        if self.hook is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the KV is in memory before an agent reads it
            self.hook.on_context_done(rid, kv.get_batch_cache_indices([rid])[0], kv.num_tokens(rid),
                                      op.first_token)

    _OPS = {P.Free: _op_free, P.Reuse: _op_reuse, P.Xfer: _op_xfer, P.Ready: _op_ready,
            P.ConnAlloc: _op_conn_alloc, P.Release: _op_release, P.Write: _op_write,
            P.HookAbort: _op_hook_abort, P.CtxDone: _op_ctx_done}

    # --- the batch (the forward pass and sampling) ------------------------------------------------------
    def _run_batch(self, batch: tuple[BatchRow, ...]) -> tuple[list[int], list] | None:
        kv, sampled = self.kv, None
        needs = [(r.rid, r.start + len(r.tokens)) for r in batch]
        kv.prepare_resources(needs)
        rows = kv.get_batch_cache_indices([r.rid for r in batch])
        sb = StepBatch.build([(r.tokens, r.start, blocks, True) for r, blocks in zip(batch, rows)],
                             kv.tokens_per_block, self.device)
        out = self._forward(sb, [(r.rid, list(blocks), n) for r, blocks, (_, n) in zip(batch, rows, needs)
                                 if r.context_only])
        if not self.model.last:
            self.comm.send_next_stage(out)
        elif self.rank == self.sampler_rank:
            sampled = self._sample(batch, out, [n for _, n in needs])
        if self.rank == 0 and self.rank != self.sampler_rank:
            sampled = self._receive_sampled(batch)
        kv.update_resources(needs, {r.rid: r.tokens for r in batch})
        for r in batch:
            if r.context_only:
                kv.pin(r.rid)
        return sampled

    # --- post ops (after the step), one method each --------------------------------------------------------
    def _post_read(self, op: P.Read) -> None:
        self._read_kv(op.rid)

    def _post_drop(self, op: P.Drop) -> None:
        self.inbox.take_kv(op.rid, self.timeout)

    def _post_digest(self, op: P.Digest) -> None:
        self.pipes.send(self.digests.report(op.rid, self.kv))

    def _post_stats(self, op: P.Stats) -> None:
        kv = self.kv
        self.pipes.send(pm.RankStats(self.rank, kv.get_num_free_blocks(), list(kv.request_ids()),
                                     kv.get_num_cached_blocks(), kv.reused_tokens))

    _POST = {P.Read: _post_read, P.Drop: _post_drop, P.Digest: _post_digest, P.Stats: _post_stats}

    def _forward(self, sb: StepBatch, ctx_only: list[tuple[int, list[int], int]]):
        """The stage's forward pass (a later PP stage first receives the previous stage's hidden states).

        With streaming, this step's context-only prefills are published first (before a later stage waits for
        its input, so generation ranks can fetch meanwhile) and their layers marked ready as they are written;
        a forward pass that fails marks nothing more (the rank stops with the error)."""
        streaming = self.streamer is not None and self.streamer.begin(ctx_only)
        hidden = None
        if not self.model.first:
            hidden = self.comm.recv_prev_stage((sb.num_tokens, self.mcfg.hidden_size), self.model.dtype)
        if not streaming:
            return self.model.forward(sb, hidden)
        self.model.layer_done = self.streamer.layer_done
        try:
            out = self.model.forward(sb, hidden)
        except BaseException:
            self.streamer.abandon()
            raise
        finally:
            self.model.layer_done = None
        self.streamer.end()
        return out

    # --- sampling (on the last stage's first TP rank; the leader gets tokens and logprobs) -----------------
    def _sample(self, batch: list, logits: torch.Tensor, positions: list[int]) -> tuple[list[int], list]:
        params = [r.sampling for r in batch]
        hist = [r.history for r in batch]
        toks, lps = sample_step(logits, params, positions, hist)
        if self.rank != 0:
            self.comm.send_tokens_to_leader(torch.tensor(toks, dtype=torch.int64))
            k = logprob_width(params)
            if k:
                self.comm.send_tokens_to_leader(pack_logprobs(lps, k))
        return toks, lps

    def _receive_sampled(self, batch: list) -> tuple[list[int], list]:
        toks = self.comm.recv_tokens_from(self.sampler_rank, len(batch)).tolist()
        params = [r.sampling for r in batch]
        k = logprob_width(params)
        if not k:
            return toks, [None] * len(batch)
        flat = self.comm.recv_tokens_from(self.sampler_rank, len(batch) * (1 + 2 * k))
        return toks, unpack_logprobs(flat, params, k, self.mcfg.vocab_size)

    # --- KV in and out (tests and tools; the transceiver moves KV with its agents) -------------------------
    def _read_kv(self, rid: int) -> None:
        kv = self.kv
        x = gather_blocks(kv.pool, kv.get_batch_cache_indices([rid])[0], kv.num_tokens(rid)).cpu()
        self.pipes.send(pm.KvShard(rid, list(x.shape), self.layout.shape.dtype, self.rank),
                        x.view(torch.uint8).numpy().tobytes())

    def _write_kv(self, rid: int) -> None:
        kv = self.kv
        msg, payload = self.inbox.take_kv(rid, self.timeout)
        n = kv.num_tokens(rid)
        p = kv.pool.shape
        want = [p[1], p[2], p[3], n, p[5]]
        if msg.shape != want or msg.dtype != self.layout.shape.dtype:
            raise ExecutorError(f"write_kv of request {rid} on rank {self.rank}: got shape {msg.shape} "
                                f"{msg.dtype}, the rank holds {want} {self.layout.shape.dtype}")
        x = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(kv.pool.dtype).reshape(want)
        scatter_blocks(kv.pool, kv.get_batch_cache_indices([rid])[0], x)


def _follower_loop(run: _Runner) -> None:
    while True:
        plan = StepPlan.from_wire(run.comm.broadcast_plan(None))
        if plan.stop:
            return
        run.execute(plan)
        run.exchange()
        run.exchange_connector()


def rank_main(rank: int, blob: bytes, rx, tx) -> None:
    """Entry point of a rank process (spawned by runtime.Executor). `blob` is the msgpack executor config."""
    pipes = Pipes(rx, tx, pm.decode_command)
    run = None
    try:
        cfg: dict[str, Any] = codec.unpack(blob, what="executor config")
        torch.set_num_threads(int(cfg["threads_per_rank"]))
        inbox = Inbox(pipes)
        inbox.start()
        run = _Runner(cfg, rank, pipes, inbox)
        freeze_startup_heap()  # model and transceiver loaded: later collections skip them (gcheap.py)
        pipes.send(pm.RankReady(rank, run.mcfg.to_dict(), run.layout.to_wire(), os.getpid()))
        if rank == 0:
            leader_loop(run, pipes, inbox, cfg)
        else:
            _follower_loop(run)
        inbox.closed = True
        pipes.send(pm.RankExit(rank))
    except BaseException as e:  # noqa: BLE001 - report every failure to the parent, then exit non-zero
        try:
            pipes.send(pm.RankError(rank, f"{type(e).__name__}: {e}", traceback.format_exc()))
        except Exception:  # noqa: BLE001
            pass
        sys.exit(1)
    finally:
        if run is not None:
            if run.conn is not None:
                try:
                    run.conn.close()  # waits (bounded) for the connector's in-flight saves
                except Exception:  # noqa: BLE001 - closing is best effort; the error path already reported
                    pass
            if run.hook is not None and hasattr(run.hook, "close"):
                try:
                    run.hook.close()
                except Exception:  # noqa: BLE001 - closing is best effort; the error path already reported
                    pass
            run.comm.close()
