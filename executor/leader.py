"""Rank 0's loop: the parent's commands into the Engine, one step plan per step broadcast to every rank, the
step's events back to the parent, and the rank hooks' reports acted on once all ranks agree (HookTally).

Runs inside the leader rank process (worker.py's rank_main). Never frees a block itself: every change to
the pools goes through a plan that every rank runs.
"""

from __future__ import annotations

import queue
import time

from .. import codec
from ..errors import ExecutorError
from .engine import Engine, Request, empty_plan
from .hooks import HOOK_IDLE_S, HookTally
from .pipes import Inbox, Pipes
from .sampling import SamplingParams

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
    tally = HookTally(run.layout.world_size)
    idle_wait = HOOK_IDLE_S if run.hook is not None or conn is not None else 0.02
    quiet_wait = idle_wait  # grows while the engine holds no request (nothing a hook could report on)
    last_bcast = time.monotonic()
    while True:
        wait = 0.0 if eng.has_work() else quiet_wait
        post: list[list] = []
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
            plan = empty_plan(eng.step)
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
            _act_on_agreement(eng, tally, reports)
        creps = run.exchange_connector()
        if creps is not None:
            eng.connector_done(*conn.on_reports(creps))
        quiet_wait = min(quiet_wait * 2, HOOK_QUIET_S) if idle and not eng.requests else idle_wait
    if conn is not None:  # one more plan, so saves of requests that finished just before the stop are posted
        plan = empty_plan(eng.step, conn=conn.plan_section([]), free_before=run.kv.get_num_free_blocks())
        run.comm.broadcast_plan(codec.pack(plan))
        run.execute(plan)
        run.exchange()
        run.exchange_connector()
        conn.close()
    run.comm.broadcast_plan(codec.pack(empty_plan(eng.step, stop=True)))


def _take_commands(inbox: Inbox, wait: float) -> list[dict]:
    """The parent's commands waiting now (waiting up to `wait` for the first one)."""
    cmds = []
    try:
        cmds.append(inbox.commands.get(timeout=wait) if wait else inbox.commands.get_nowait())
        while True:
            cmds.append(inbox.commands.get_nowait())
    except queue.Empty:
        pass
    return cmds


def _act_on_agreement(eng: Engine, tally: HookTally, reports: list[dict]) -> None:
    """What every rank's hook reports agree on this step (any rank's abort ends a request at once)."""
    agreed = tally.add(reports)
    # (a request the client aborted meanwhile is gone already: its hooks' reports only settle it)
    for rid in agreed["abort"]:  # its blocks wait for "settled"
        note = tally.take_note(rid)
        tally.take_stats(rid)  # some rank's pull may have finished: the request ends all the same
        if rid in eng.requests:
            eng.abort(rid, note)
    for rid in agreed["release"]:
        if rid in eng.requests:
            eng.release(rid)
    for rid in agreed["kv_ready"]:
        tally.take_note(rid)
        stats = tally.take_stats(rid)
        if rid in eng.requests:
            eng.kv_ready(rid, stats)
    for rid in agreed["settled"]:  # every rank reported: an aborted request's blocks may go now
        eng.hook_settled(rid)


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
