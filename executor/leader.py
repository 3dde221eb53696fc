"""Rank 0's loop: the parent's commands into the Engine, one step plan per step broadcast to every rank, the
step's events back to the parent, and the rank hooks' reports acted on once all ranks agree (HookTally).

Runs inside the leader rank process (worker.py's rank_main). Never frees a block itself: every change to
the pools goes through a plan that every rank runs.
"""

from __future__ import annotations

import queue
import time
from dataclasses import replace

from ..errors import ExecutorError
from . import events as E
from . import pipe_messages as pm
from . import plan as P
from .engine import Engine, Request
from .hooks import HOOK_IDLE_S, HookReport, HookTally
from .pipes import Inbox, Pipes
from .plan import StepPlan

__all__ = ["leader_loop"]

HEARTBEAT_S = 0.2   # an idle leader still broadcasts an empty plan this often, so no rank's wait runs out
HOOK_QUIET_S = 0.1  # idle rounds back off to this while no request exists (a command still wakes at once)


def leader_loop(run, pipes: Pipes, inbox: Inbox, cfg: dict) -> None:
    """Rank 0's loop until a stop command: commands in, a plan per step out (run by `run`, the rank's
    runner, on every rank), events to the parent, the hooks' reports acted on once every rank agrees."""
    conn = None
    if run.conn is not None:
        from .connector.leader import ConnectorLeader

        conn = ConnectorLeader(cfg, run.kv, run.mcfg.to_dict())
    eng = Engine(cfg["num_blocks"], cfg["tokens_per_block"], max_batch_tokens=cfg["max_batch_tokens"],
                 max_batch_seqs=cfg["max_batch_seqs"], max_position=run.mcfg.max_position,
                 vocab_size=run.mcfg.vocab_size, connector=conn, hooked=run.hook is not None,
                 match_prefix=run.kv.match_prefix if run.kv.block_reuse else None)
    pub = None
    if cfg.get("kv_events") and run.kv.block_reuse:  # KV events of this worker (kv_publisher.py)
        from .kv_publisher import KVEventPublisher

        pub = KVEventPublisher(cfg["kv_events"], run.kv.prefix_tree, run.device.type.upper())
    tally = HookTally(run.layout.world_size)
    idle_wait = HOOK_IDLE_S if run.hook is not None or conn is not None else 0.02
    quiet_wait = idle_wait  # grows while the engine holds no request (nothing a hook could report on)
    last_bcast = time.monotonic()
    while True:
        if pub is not None:
            pub.flush()
        wait = 0.0 if eng.has_work() else quiet_wait
        post: list = []  # post ops (plan.py) the commands asked for
        if any([_apply_command(eng, c, post) for c in _take_commands(inbox, wait)]):
            break
        idle = not eng.has_work() and not post
        if idle:
            for ev in eng.take_events():
                pipes.send(ev)
            if run.hook is None and conn is None and (not run.comm.enabled
                                                      or time.monotonic() - last_bcast < HEARTBEAT_S):
                continue
            # an empty plan: keeps the followers' waits alive and gives hooks their poll
            plan = StepPlan.empty(eng.step, free_before=run.kv.get_num_free_blocks())
        else:
            plan = replace(eng.next_plan(), free_before=run.kv.get_num_free_blocks())
            for ev in eng.take_started():  # overlap: the parent hands the request over while it prefills
                pipes.send(ev)
            if post:
                plan = replace(plan, post=plan.post + tuple(post))
        run.comm.broadcast_plan(plan.encode())
        last_bcast = time.monotonic()
        sampled, logprobs = run.execute(plan) or ([], [])
        if not idle:
            _report(eng.step_done(plan, sampled, logprobs), run, pipes)
        reports = run.exchange()
        if reports is not None:
            _act_on_agreement(eng, tally, reports)
        creps = run.exchange_connector()
        if creps is not None:
            eng.connector_done(*conn.on_reports(creps))
        quiet_wait = min(quiet_wait * 2, HOOK_QUIET_S) if idle and not eng.requests else idle_wait
    if conn is not None:  # one more plan, so saves of requests that finished just before the stop are posted
        plan = StepPlan.empty(eng.step, conn=conn.plan_section([]), free_before=run.kv.get_num_free_blocks())
        run.comm.broadcast_plan(plan.encode())
        run.execute(plan)
        run.exchange()
        run.exchange_connector()
        conn.close()
    run.comm.broadcast_plan(StepPlan.empty(eng.step, stop=True).encode())
    if pub is not None:
        pub.close()


def _report(events: list, run, pipes: Pipes) -> None:
    """A step's events to the parent; Ctx and GenAlloc get the request's block ids (rank 0's, every rank's)."""
    for ev in events:
        if isinstance(ev, (E.Ctx, E.GenAlloc)):
            ev = replace(ev, block_ids=list(run.kv.get_batch_cache_indices([ev.rid])[0]))
        pipes.send(ev)


def _take_commands(inbox: Inbox, wait: float) -> list:
    """The parent's commands waiting now (waiting up to `wait` for the first one)."""
    cmds = []
    try:
        cmds.append(inbox.commands.get(timeout=wait) if wait else inbox.commands.get_nowait())
        while True:
            cmds.append(inbox.commands.get_nowait())
    except queue.Empty:
        pass
    return cmds


def _act_on_agreement(eng: Engine, tally: HookTally, reports: list[HookReport]) -> None:
    """What every rank's hook reports agree on this step (any rank's abort ends a request at once)."""
    agreed = tally.add(reports)
    # (a request the client aborted meanwhile is gone already: its hooks' reports only settle it)
    for rid in agreed.abort:  # its blocks wait for "settled"
        note = tally.take_note(rid)
        tally.take_stats(rid)  # some rank's pull may have finished: the request ends all the same
        if rid in eng.requests:
            eng.abort(rid, note)
    for rid in agreed.release:
        if rid in eng.requests:
            eng.release(rid)
    for rid in agreed.kv_ready:
        tally.take_note(rid)
        stats = tally.take_stats(rid)
        if rid in eng.requests:
            eng.kv_ready(rid, stats)
    for rid in agreed.settled:  # every rank reported: an aborted request's blocks may go now
        eng.hook_settled(rid)


def _apply_command(eng: Engine, c, post: list) -> bool:
    """Apply one parent command (pipe_messages.py) to the engine; True for Stop. A KV read/write, digest or
    block count becomes a post op of the next plan (`post`). Fatal (the parent's pipe failed) raises."""
    if isinstance(c, pm.Fatal):
        raise ExecutorError(c.msg)
    if isinstance(c, pm.Stop):
        return True
    apply = _COMMANDS.get(type(c))
    if apply is None:  # (decoding admits only commands: a message the inbox has no use for)
        eng.error(getattr(c, "rid", -1), f"the leader has no use for a {type(c).__name__} message")
    else:
        apply(eng, c, post)
    return False


def _add(eng: Engine, c: pm.Add, post: list) -> None:
    eng.submit(Request(c.rid, [int(x) for x in c.prompt], c.max_tokens, c.mode, c.sampling,
                       tuple(int(x) for x in c.stop_ids), c.first_token, dict(c.ctx_info), stream=c.stream))


def _write(eng: Engine, c: pm.WriteKv, post: list) -> None:
    if not eng.io("write", c.rid):
        post.append(P.Drop(c.rid))  # every rank discards the shard it was sent


_COMMANDS = {
    pm.Add: _add,
    pm.Join: lambda eng, c, post: eng.join(c.rid, c.first_token),
    pm.KvReady: lambda eng, c, post: eng.kv_ready(c.rid),
    pm.Release: lambda eng, c, post: eng.release(c.rid),
    pm.Abort: lambda eng, c, post: eng.abort(c.rid),
    pm.ReadKv: lambda eng, c, post: eng.io("read", c.rid),
    pm.WriteKv: _write,
    pm.QueryStats: lambda eng, c, post: post.append(P.Stats()),
    pm.QueryDigest: lambda eng, c, post: post.append(P.Digest(c.rid)),
}
