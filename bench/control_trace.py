"""Where one request's time goes in `kvbridge bench control`: a time stamp at every hop, both processes.

Runs bench/control.py's context rank and one generation rank, one request at a time, with the transceiver's
methods wrapped to note CLOCK_MONOTONIC (the same clock in both processes) when each hop happens; prints, per
hop, the median and p90 time since the request was published. A diagnostic: it wraps private methods by
name, so it follows the code it measures (hops a version lacks are simply missing from its table).

    python -m kvbridge.bench.control_trace [--requests 300] [--agent nixl] [--no-read-ahead]
"""

from __future__ import annotations

import argparse
import sys
import time
import types

import numpy as np

T: dict[int, dict[str, float]] = {}


def mark(name: str, rid: int) -> None:
    T.setdefault(int(rid), {}).setdefault(name, time.monotonic())


def _wrap(cls, meth: str, name: str, rid_of) -> None:
    orig = getattr(cls, meth, None)
    if orig is None:
        return

    def wrapped(self, *a, **k):
        mark(name, rid_of(*a))
        return orig(self, *a, **k)

    setattr(cls, meth, wrapped)


def _patch_context() -> None:
    from kvbridge.transceiver import CacheTransceiver
    from kvbridge.transceiver import sender as S

    _wrap(S.Sender, "publish", "c.publish", lambda rid, *a: rid)
    _wrap(S.Sender, "_on_publish", "c.io_publish", lambda c: c.rid)
    _wrap(S.Sender, "_on_fetch", "c.io_fetch", lambda ident, msg: msg.ctx_request_id)
    _wrap(S.Sender, "_on_done", "c.io_done", lambda ident, msg: msg.ctx_request_id)
    # a frame's arrival at the context I/O thread, before it is decoded (its request is not known yet: one request
    # at a time, it is the last one published), and the finished request handed to the owner
    _wrap(S.Sender, "_on_frames", "c.io_frames", lambda frames: max(T, default=0))
    _wrap(S.Sender, "_report", "c.report", lambda result: result.ctx_request_id)
    orig = CacheTransceiver.check_context_transfer_status

    def status(self, *a, **k):
        out = orig(self, *a, **k)
        for r in out:
            mark("c.owner_has_it", r.ctx_request_id)
        return out

    CacheTransceiver.check_context_transfer_status = status


def _patch_generation() -> None:
    from kvbridge.transceiver import pull as P
    from kvbridge.transceiver import receiver as R

    _wrap(R.Receiver, "submit", "g.submit", lambda rid, params, *a: params.ctx_request_id)
    _wrap(R.Receiver, "_on_submit", "g.io_submit", lambda c: c.params.ctx_request_id)
    _wrap(R.Receiver, "_send_fetch", "g.fetch_sent", lambda pull, *a: pull.ctx_request_id)
    _wrap(R.Receiver, "_on_blocks", "g.io_blocks", lambda pull, *a: pull.ctx_request_id)
    _wrap(R.Receiver, "_step_confirm", "g.reads_done", lambda pull, *a: pull.ctx_request_id)
    _wrap(R.Receiver, "_on_done_ack", "g.io_done_ack", lambda pull, *a: pull.ctx_request_id)
    try:  # later versions: the handlers of frames about one request live in receiver_legs.py
        from kvbridge.transceiver import receiver_legs as L
    except ImportError:
        L = None
    try:  # later versions: the handshake step (the Fetch) lives in receiver_handshake.py
        from kvbridge.transceiver import receiver_handshake as H
    except ImportError:
        H = None
    if H is not None:
        _wrap(H.Handshake, "_send_fetch", "g.fetch_sent", lambda pull, *a: pull.ctx_request_id)
    if L is not None:
        _wrap(L.LegFrames, "blocks", "g.io_blocks", lambda pull, *a: pull.ctx_request_id)
        _wrap(L.LegFrames, "done_ack", "g.io_done_ack", lambda pull, *a: pull.ctx_request_id)
    orig = P.Pull.post_ready_layers

    def post(self, *a):
        out = orig(self, *a)
        mark("g.read_posted", self.ctx_request_id)
        return out

    P.Pull.post_ready_layers = post


class _TracedPipe:
    """The generation rank's end of bench/control.py's pipe: notes when params arrive, ships its stamps."""

    def __init__(self, conn) -> None:
        self.c = conn

    def poll(self, t):
        return self.c.poll(t)

    def fileno(self) -> int:  # the rank waits on it with select.poll
        return self.c.fileno()

    def recv(self):
        x = self.c.recv()
        if isinstance(x, tuple):
            mark("g.params_in", x[1]["ctx_request_id"])
        return x

    def send(self, x):
        if isinstance(x, dict) and "ok" in x:
            x["trace"] = T
        return self.c.send(x)


def _gen_main(conn, agent: str) -> None:
    _patch_generation()
    from kvbridge.bench import control as C

    C._gen_main(_TracedPipe(conn), agent)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvbridge.bench.control_trace", description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--agent", default="nixl")
    ap.add_argument("--no-read-ahead", action="store_true")
    args = ap.parse_args(argv)
    _patch_context()
    import multiprocessing as mp

    from kvbridge.bench import control as C

    spawn = mp.get_context("spawn")
    C.mp = types.SimpleNamespace(get_context=lambda _k: types.SimpleNamespace(
        Pipe=spawn.Pipe, Process=lambda target, args, daemon: spawn.Process(target=_gen_main, args=args,
                                                                            daemon=daemon)))
    try:
        rank = C._ContextRank(1, args.agent, not args.no_read_ahead)
    except TypeError:  # an older bench/control.py: no read-ahead switch
        rank = C._ContextRank(1, args.agent)
    publish = rank.publish

    def traced_publish(gen):
        rid = rank.next_rid
        publish(gen)
        mark("c.params_out", rid)

    rank.publish = traced_publish
    rank.measure(100, 1, 60)
    T.clear()
    lat, _ = rank.measure(args.requests, 1, 120)
    for c in rank.conns:
        c.send(None)
    gen_t = rank.conns[0].recv().get("trace", {}) if rank.conns[0].poll(60) else {}
    for p in rank.procs:
        p.join(10)
    rank.ctx.close()
    rows = [{**ct, **gen_t[rid]} for rid, ct in T.items() if rid in gen_t and "c.publish" in ct]
    if not rows:
        print("no complete traces")
        return 1
    names = sorted({k for r in rows for k in r}, key=lambda k: np.median([r[k] - r["c.publish"] for r in rows
                                                                           if k in r]))
    print(f"# {len(rows)} requests, one at a time; publish -> complete p50 {np.median(lat):.0f} us")
    for k in names:
        d = [(r[k] - r["c.publish"]) * 1e6 for r in rows if k in r]
        print(f"{k:16s} +{np.median(d):8.1f} us  (p90 {np.percentile(d, 90):8.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
