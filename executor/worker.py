"""One rank process: loads its shard, builds its pool, and runs step plans in lockstep with the other ranks.

Rank 0 is the leader: it reads commands from the parent (`Executor`), plans each step with the `Engine`,
broadcasts the plan (msgpack bytes in a tensor), runs it like every other rank, and reports events. Other
ranks only run plans. Every rank talks to the parent over its own pair of pipes with msgpack frames (never
pickle): KV shards for `read_kv`/`write_kv`, KV digests (`kv_check.py`), its readiness, and its fatal error (then it exits non-zero).

Never frees a block except as a plan says, so every rank's allocator stays identical to the leader's; the
plan carries the leader's free-block count before its ops and each rank checks it.
"""

from __future__ import annotations

import os
import queue
import sys
import time
import traceback
from typing import Any

import torch

from .. import codec
from ..errors import ExecutorError
from ..formatter.layout import ParallelSplit
from .comm import Comm
from .config import kv_layout_for
from .engine import Engine, Request
from .hooks import HOOK_IDLE_S, HookTally, RankContext, exchange_reports, load_hook, validate_report
from .kv_cache_manager import TORCH_DTYPES, KVCacheManager
from .kv_check import DigestBook
from .kv_io import gather_blocks, scatter_blocks
from .model import StageModel, StepBatch
from .pipes import Inbox, Pipes
from .sampling import SamplingParams, TokenHistory, logprob_width, pack_logprobs, sample_step, unpack_logprobs
from .sources import load_source
from .streaming import LayerStreamer, supports_streaming
from .weights import stage_weights

__all__ = ["rank_main"]

HEARTBEAT_S = 0.2   # an idle leader still broadcasts an empty plan this often, so no rank's wait runs out
HOOK_QUIET_S = 0.1  # idle rounds back off to this while no request exists (a command still wakes at once)
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
        self.comm = Comm(self.layout, rank, cfg["port"], self.device, self.timeout)
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

    def exchange(self) -> list[dict] | None:
        """After a step: every rank's hook report, gathered on every rank (None without hooks)."""
        if self.hook is None:
            return None
        return exchange_reports(self.comm, validate_report(self.hook.poll(), self.rank))

    def exchange_connector(self) -> list[dict] | None:
        """After a step: every rank's connector report (get_finished), on every rank (None without one)."""
        return None if self.conn is None else self.conn.exchange(self.comm)

    # --- one plan -------------------------------------------------------------------------------------
    def execute(self, plan: dict) -> tuple[list[int], list] | None:
        """Run one plan; on rank 0 returns (sampled tokens, wire logprob entries or None), one per entry."""
        kv = self.kv
        if plan.get("free_before", kv.get_num_free_blocks()) != kv.get_num_free_blocks():
            raise ExecutorError(f"rank {self.rank}: {kv.get_num_free_blocks()} free blocks before step "
                                f"{plan['step']}, the leader has {plan['free_before']}: allocators diverged")
        for op in plan["ops"]:
            kind, rid = op[0], int(op[1])
            if kind == "free":
                kv.free_resources(rid)
            elif kind == "reuse":  # block reuse: the request starts on the cached blocks of its prompt prefix
                kv.add_sequence_reusing(rid, [int(t) for t in op[2]], int(op[3]))
            elif kind == "xfer":
                reused = int(op[4]) if len(op) > 4 else 0
                blocks = kv.add_sequence_for_transfer(rid, int(op[2]), op[5] if len(op) > 5 else None, reused)
                if self.hook is not None:
                    info = dict(op[3]) if len(op) > 3 else {}
                    info["reused_tokens"] = reused  # set here, never taken from the client's ctx_info
                    self.hook.on_generation_alloc(rid, blocks, int(op[2]), info)
            elif kind == "ready":
                kv.mark_ready(rid)
                if self.record_digests:  # the prompt KV just arrived: hash it before decoding appends
                    self.digests.record(rid, kv)
            elif kind == "conn_alloc":  # blocks the KV connector loads a stored prompt prefix into
                kv.add_sequence_for_transfer(rid, int(op[2]), op[3] if len(op) > 3 else None)
            elif kind == "release":
                kv.free_resources(rid)
                kv.unpin(rid)
            elif kind == "write":
                self._write_kv(rid)
            elif kind == "hook_abort":  # the request was aborted: its transfer must stop before blocks go
                if self.hook is not None and hasattr(self.hook, "on_abort"):
                    self.hook.on_abort(rid)
            elif kind == "ctx_done":  # the previous step's context-only prefill, with its first token
                if self.record_digests:
                    self.digests.record(rid, kv)
                if self.hook is not None:
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)  # the KV is in memory before an agent reads it
                    self.hook.on_context_done(rid, kv.get_batch_cache_indices([rid])[0], kv.num_tokens(rid),
                                              int(op[2]))
            else:
                raise ExecutorError(f"step {plan['step']}: unknown op {kind!r}")
        batch = plan["batch"]
        sampled = None
        if self.conn is not None and "conn" in plan:
            self.conn.begin_step(plan["conn"])  # bind_connector_meta + start_load_kv
        if batch:
            needs = [(int(b[0]), int(b[1]) + len(b[2])) for b in batch]
            kv.prepare_resources(needs)
            rows = kv.get_batch_cache_indices([n[0] for n in needs])
            sb = StepBatch.build([(b[2], int(b[1]), blocks, True) for b, blocks in zip(batch, rows)],
                                 kv.tokens_per_block, self.device)
            out = self._forward(sb, [(int(b[0]), list(blocks), n) for b, blocks, (_, n)
                                     in zip(batch, rows, needs) if b[4]])
            if not self.model.last:
                self.comm.send_next_stage(out)
            elif self.rank == self.sampler_rank:
                sampled = self._sample(batch, out, [n for _, n in needs])
            if self.rank == 0 and self.rank != self.sampler_rank:
                sampled = self._receive_sampled(batch)
            kv.update_resources(needs, {int(b[0]): b[2] for b in batch})
            for b in batch:
                if b[4]:
                    kv.pin(int(b[0]))
        if self.conn is not None and "conn" in plan:
            self.conn.end_step()  # wait_for_save
        for op in plan.get("post", ()):
            if op[0] == "read":
                self._read_kv(int(op[1]))
            elif op[0] == "drop":
                self.inbox.take_kv(int(op[1]), self.timeout)
            elif op[0] == "digest":
                self.pipes.send(self.digests.report(int(op[1]), kv).to_wire())
            elif op[0] == "stats":
                self.pipes.send({"t": "stats", "rank": self.rank, "free": kv.get_num_free_blocks(),
                                 "live": kv.request_ids(), "cached": kv.get_num_cached_blocks(),
                                 "reused": kv.reused_tokens})
            else:
                raise ExecutorError(f"step {plan['step']}: unknown post op {op[0]!r}")
        return sampled

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
        params = [SamplingParams.from_wire(b[5]) for b in batch]
        hist = [TokenHistory.from_wire(b[6]) for b in batch]
        toks, lps = sample_step(logits, params, positions, hist)
        if self.rank != 0:
            self.comm.send_tokens_to_leader(torch.tensor(toks, dtype=torch.int64))
            k = logprob_width(params)
            if k:
                self.comm.send_tokens_to_leader(pack_logprobs(lps, k))
        return toks, [None if e is None else e.to_wire() for e in lps]

    def _receive_sampled(self, batch: list) -> tuple[list[int], list]:
        toks = self.comm.recv_tokens_from(self.sampler_rank, len(batch)).tolist()
        params = [SamplingParams.from_wire(b[5]) for b in batch]
        k = logprob_width(params)
        if not k:
            return toks, [None] * len(batch)
        flat = self.comm.recv_tokens_from(self.sampler_rank, len(batch) * (1 + 2 * k))
        lps = unpack_logprobs(flat, params, k, self.mcfg.vocab_size)
        return toks, [None if e is None else e.to_wire() for e in lps]

    # --- KV in and out (tests and tools; the transceiver moves KV with its agents) -------------------------
    def _read_kv(self, rid: int) -> None:
        kv = self.kv
        x = gather_blocks(kv.pool, kv.get_batch_cache_indices([rid])[0], kv.num_tokens(rid)).cpu()
        self.pipes.send({"t": "kv", "rid": rid, "rank": self.rank, "shape": list(x.shape),
                         "dtype": self.layout.shape.dtype, "has_payload": True},
                        x.view(torch.uint8).numpy().tobytes())

    def _write_kv(self, rid: int) -> None:
        kv = self.kv
        msg, payload = self.inbox.take_kv(rid, self.timeout)
        n = kv.num_tokens(rid)
        p = kv.pool.shape
        want = [p[1], p[2], p[3], n, p[5]]
        if msg.get("shape") != want or msg.get("dtype") != self.layout.shape.dtype:
            raise ExecutorError(f"write_kv of request {rid} on rank {self.rank}: got shape "
                                f"{msg.get('shape')} "
                                f"{msg.get('dtype')}, the rank holds {want} {self.layout.shape.dtype}")
        x = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(kv.pool.dtype).reshape(want)
        scatter_blocks(kv.pool, kv.get_batch_cache_indices([rid])[0], x)


def _leader_loop(run: _Runner, pipes: Pipes, inbox: Inbox, cfg: dict) -> None:
    conn = None
    if run.conn is not None:
        from .connector.leader import ConnectorLeader

        conn = ConnectorLeader(cfg, run.kv, run.mcfg.to_dict())
    eng = Engine(cfg["num_blocks"], cfg["tokens_per_block"], max_batch_tokens=cfg["max_batch_tokens"],
                 max_batch_seqs=cfg["max_batch_seqs"], max_position=run.mcfg.max_position,
                 vocab_size=run.mcfg.vocab_size, connector=conn, hooked=run.hook is not None,
                 match_prefix=run.kv.match_prefix if run.kv.block_reuse else None)
    tally = HookTally(run.layout.world_size)
    idle_wait = HOOK_IDLE_S if run.hook is not None or conn is not None else 0.02
    quiet_wait = idle_wait  # grows while the engine holds no request (nothing a hook could report on)
    last_bcast = time.monotonic()
    while True:
        wait = 0.0 if eng.has_work() else quiet_wait
        cmds = []
        try:
            cmds.append(inbox.commands.get(timeout=wait) if wait else inbox.commands.get_nowait())
            while True:
                cmds.append(inbox.commands.get_nowait())
        except queue.Empty:
            pass
        post: list[list] = []
        if any([_apply_command(eng, c, post) for c in cmds]):
            break
        idle = not eng.has_work() and not post
        if idle:
            for ev in eng.take_events():
                pipes.send(ev)
            if run.hook is None and conn is None and (not run.comm.enabled
                                                      or time.monotonic() - last_bcast < HEARTBEAT_S):
                continue
            # an empty plan: keeps the followers' waits alive and gives hooks their poll
            plan = {"v": 1, "step": eng.step, "stop": False, "ops": [], "batch": [], "post": []}
        else:
            plan = eng.next_plan()
            plan["post"] = plan["post"] + post
        plan["free_before"] = run.kv.get_num_free_blocks()
        run.comm.broadcast_plan(codec.pack(plan))
        last_bcast = time.monotonic()
        sampled, logprobs = run.execute(plan) or ([], [])
        if not idle:
            for ev in eng.step_done(plan, sampled, logprobs):
                if ev["t"] in ("ctx", "gen_alloc"):
                    ev["block_ids"] = run.kv.get_batch_cache_indices([ev["rid"]])[0]
                pipes.send(ev)
        reports = run.exchange()
        if reports is not None:
            agreed = tally.add(reports)
            # (a request the client aborted meanwhile is gone already: its hooks' reports only settle it)
            for rid in agreed["abort"]:  # any rank: the request ends now; its blocks wait for "settled"
                note = tally.take_note(rid)
                if rid in eng.requests:
                    eng.abort(rid, note)
            for rid in agreed["release"]:
                if rid in eng.requests:
                    eng.release(rid)
            for rid in agreed["kv_ready"]:
                note = tally.take_note(rid)
                if rid in eng.requests:
                    eng.kv_ready(rid, note)
            for rid in agreed["settled"]:  # every rank reported: an aborted request's blocks may go now
                eng.hook_settled(rid)
        creps = run.exchange_connector()
        if creps is not None:
            eng.connector_done(*conn.on_reports(creps))
        quiet_wait = min(quiet_wait * 2, HOOK_QUIET_S) if idle and not eng.requests else idle_wait
    if conn is not None:  # one more plan, so saves of requests that finished just before the stop are posted
        plan = {"v": 1, "step": eng.step, "stop": False, "ops": [], "batch": [], "post": [],
                "conn": conn.plan_section([]), "free_before": run.kv.get_num_free_blocks()}
        run.comm.broadcast_plan(codec.pack(plan))
        run.execute(plan)
        run.exchange()
        run.exchange_connector()
        conn.close()
    run.comm.broadcast_plan(codec.pack({"v": 1, "step": eng.step, "stop": True, "ops": [], "batch": [],
                                        "post": []}))


def _apply_command(eng: Engine, c: dict, post: list) -> bool:
    t = c["t"]
    if t == "fatal":
        raise ExecutorError(c["msg"])
    try:
        if t == "stop":
            return True
        if t == "add":
            sp = SamplingParams.from_wire(c["sampling"])
            ft = c.get("first_token")
            eng.submit(Request(int(c["rid"]), [int(x) for x in c["prompt"]], int(c["max_tokens"]),
                               str(c["mode"]),
                               sp, tuple(int(x) for x in c.get("stop_ids", ())),
                               None if ft is None else int(ft),
                               dict(c.get("ctx_info") or {}), stream=bool(c.get("stream", False))))
        elif t == "kv_ready":
            eng.kv_ready(int(c["rid"]))
        elif t == "release":
            eng.release(int(c["rid"]))
        elif t == "abort":
            eng.abort(int(c["rid"]))
        elif t in ("read", "write"):
            if not eng.io(t, int(c["rid"])) and t == "write":
                post.append(["drop", int(c["rid"])])  # every rank discards the shard it was sent
        elif t == "stats":
            post.append(["stats", 0])
        elif t == "digest":
            post.append(["digest", int(c["rid"])])
        else:
            eng._error(int(c.get("rid", -1)), f"unknown command {t!r}")
    except (KeyError, TypeError, ValueError, IndexError) as e:
        eng._error(int(c.get("rid", -1)) if isinstance(c.get("rid"), int) else -1,
                   f"malformed {t!r} command: {type(e).__name__}: {e}")
    return False


def _follower_loop(run: _Runner) -> None:
    while True:
        plan = run.comm.broadcast_plan(None)
        if plan.get("v") != 1:
            raise ExecutorError(f"rank {run.rank}: step plan version {plan.get('v')!r}, expected 1")
        if plan["stop"]:
            return
        run.execute(plan)
        run.exchange()
        run.exchange_connector()


def rank_main(rank: int, blob: bytes, rx, tx) -> None:
    """Entry point of a rank process (spawned by runtime.Executor). `blob` is the msgpack executor config."""
    pipes = Pipes(rx, tx)
    run = None
    try:
        cfg: dict[str, Any] = codec.unpack(blob, what="executor config")
        torch.set_num_threads(int(cfg["threads_per_rank"]))
        inbox = Inbox(pipes)
        inbox.start()
        run = _Runner(cfg, rank, pipes, inbox)
        pipes.send({"t": "ready", "rank": rank, "config": run.mcfg.to_dict(), "layout": run.layout.to_wire(),
                    "pid": os.getpid()})
        if rank == 0:
            _leader_loop(run, pipes, inbox, cfg)
        else:
            _follower_loop(run)
        inbox.closed = True
        pipes.send({"t": "exit", "rank": rank})
    except BaseException as e:  # noqa: BLE001 - report every failure to the parent, then exit non-zero
        try:
            pipes.send({"t": "error", "rank": rank, "msg": f"{type(e).__name__}: {e}",
                        "tb": traceback.format_exc()})
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
