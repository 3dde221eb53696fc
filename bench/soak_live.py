"""Soak, part A2: a live context rank hammered with mutated frames while a generation rank pulls requests.

This process is the context rank (CacheTransceiver.context over a pool of position-dependent codes). A
spawned hammer process sends mutated frames (soak_frames.FrameMutator) from 8 DEALER sockets, each opening
with a valid Hello so that mutated Fetch/Done/Heartbeat frames reach the handlers behind the session check;
a spawned generation rank keeps pulling real requests and compares its WHOLE pool after every batch. Every
real request must succeed byte-exact, and the context rank must end with nothing pinned. The pipes between
this process and its children carry our own commands only.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import numpy as np

from ..formatter.verify import pool_image
from ..transceiver import CacheTransceiver, DisaggParams, TransceiverConfig
from .soak_frames import LAY, FrameMutator

K_CTX, K_GEN, TOKENS = 16, 12, 20  # request slots (2 blocks each) in the context / generation pools
RID_BASE = 0x5A5A << 32  # real request ids: far from any id a mutated frame carries
CFG = {"agents": ("nixl",), "lease_s": 4.0, "heartbeat_s": 0.5, "pickup_timeout_s": 30.0}


def _blocks(slot: int) -> list[int]:
    return [2 * slot, 2 * slot + 1]


def _gen_main(conn, endpoint: str, instance: str) -> None:
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    nb = 2 * K_GEN
    buf = pool_image(LAY, 0, nb, [], 9).copy()
    salts: dict[int, int] = {}
    dirty: set[int] = set()
    owner = np.arange(buf.size) // LAY.block_bytes(0)
    with CacheTransceiver.generation(buf, LAY, 0, nb, TransceiverConfig(**CFG)) as gen:
        while conn.poll(300):
            cmd, items = conn.recv()
            if cmd == "exit":
                break
            for rid, cslot, gslot, secret in items:
                gen.request_and_receive_async(
                    type(
                        "R",
                        (),
                        {
                            "request_id": rid,
                            "block_ids": np.array(_blocks(gslot)),
                            "num_tokens": TOKENS,
                            "disagg_params": DisaggParams(rid, instance, (endpoint,), LAY, secret),
                        },
                    )()
                )
            try:
                res = gen.check_gen_transfer_status(len(items), timeout_s=60)
            except Exception as e:  # noqa: BLE001 - report, the parent counts it
                conn.send({"ok": 0, "failed": [(-1, type(e).__name__, str(e))], "mismatched_bytes": 0})
                continue
            by_rid = {rid: (c, g) for rid, c, g, _ in items}
            failed = []
            for r in res:
                c, g = by_rid[r.request_id]
                if r.ok:
                    salts[g] = c + 1
                    dirty.discard(g)
                else:
                    failed.append((r.request_id, r.error_type, r.error))
                    dirty.add(g)
            image = pool_image(LAY, 0, nb, [(_blocks(g), TOKENS, s) for g, s in salts.items()], 9)
            skip = np.isin(owner, [b for g in dirty for b in _blocks(g)])
            conn.send(
                {
                    "ok": sum(r.ok for r in res),
                    "failed": failed,
                    "mismatched_bytes": int(np.count_nonzero((buf != image) & ~skip)),
                }
            )


def _hammer_main(conn, endpoint: str, frames: int, seed: int) -> None:
    import zmq

    from ..formatter.mapping import MAPPING_VERSION
    from ..transceiver import messages as m

    mut = FrameMutator(seed)
    zctx = zmq.Context()
    socks = []
    for i in range(8):
        s = zctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.IDENTITY, b"hammer-%d" % i)
        s.connect(endpoint)
        s.send(m.Hello(f"hammer-{i}", 0, LAY.to_wire(), ["nixl"], mapping_version=MAPPING_VERSION).encode())
        socks.append(s)
    sent = answered = blocked = 0
    rng = np.random.default_rng(seed + 1)
    oversized = iter(mut.oversized(16))
    t0 = time.monotonic()

    def drain() -> int:
        n = 0
        for s in socks:
            while True:
                try:
                    s.recv(zmq.NOBLOCK)
                    n += 1
                except zmq.Again:
                    break
        return n

    for i, (_, frame) in enumerate(mut.stream(frames)):
        s = socks[i % len(socks)]
        parts = [frame] * (1 if rng.random() < 0.9 else int(rng.integers(2, 4)))
        if i % (frames // 16 + 1) == 0:
            parts = [next(oversized, (None, frame))[1]]  # over MAXMSGSIZE: the rank drops that connection
        while True:
            try:
                s.send_multipart(parts, zmq.NOBLOCK)
                break
            except zmq.Again:
                blocked += 1
                answered += drain()
                time.sleep(0.001)
        sent += 1
        if i % 64 == 0:
            answered += drain()
    quiet = time.monotonic()
    while time.monotonic() - quiet < 2.0:
        got = drain()
        answered += got
        if got:
            quiet = time.monotonic()
        time.sleep(0.01)
    for s in socks:
        s.close(0)
    zctx.term()
    conn.send({"sent": sent, "answered": answered, "send_blocked": blocked, "seconds": time.monotonic() - t0})


def run_live(frames: int, seed: int, batch: int = 4, progress=None, max_requests: int = 0) -> dict:
    """Hammer a live context rank with `frames` mutated frames while real requests are pulled; counts.

    Real requests are pulled while the hammer runs (at least 64), or `max_requests` of them at most when
    it is > 0 (rounded up to a whole batch; then the hammer is waited for, bounded, without more pulls)."""
    nb = 2 * K_CTX
    buf = pool_image(LAY, 0, nb, [(_blocks(c), TOKENS, c + 1) for c in range(K_CTX)], 1).copy()
    spawn = mp.get_context("spawn")
    out = {"frames": frames, "requests": 0, "ok": 0, "failed": 0, "mismatched_bytes": 0, "errors": []}
    with CacheTransceiver.context(buf, LAY, 0, nb, TransceiverConfig(**CFG)) as ctx:
        gconn, gchild = spawn.Pipe()
        hconn, hchild = spawn.Pipe()
        gen = spawn.Process(target=_gen_main, args=(gchild, ctx.endpoint, ctx.instance), daemon=True)
        ham = spawn.Process(target=_hammer_main, args=(hchild, ctx.endpoint, frames, seed), daemon=True)
        gen.start()
        ham.start()
        t0 = time.monotonic()
        finished: dict[int, str] = {}
        rid = RID_BASE
        hammer = None
        try:
            least = min(64, max_requests) if max_requests > 0 else 64
            while (hammer is None or out["requests"] < least) and not (
                0 < max_requests <= out["requests"]
            ):  # at least 64 real requests, however fast the hammer; never more than max_requests
                items = []
                for j in range(batch):
                    cslot, gslot = (rid - RID_BASE) % K_CTX, ((rid - RID_BASE) // batch * batch + j) % K_GEN
                    secret = ctx.respond_and_send_async(
                        type(
                            "R",
                            (),
                            {"request_id": rid, "block_ids": np.array(_blocks(cslot)), "num_tokens": TOKENS},
                        )()
                    )
                    items.append((rid, cslot, gslot, secret))
                    rid += 1
                gconn.send(("pull", items))
                if not gconn.poll(90):
                    raise TimeoutError("the generation rank did not answer a batch within 90 s")
                ans = gconn.recv()
                out["requests"] += len(items)
                out["ok"] += ans["ok"]
                out["failed"] += len(ans["failed"])
                out["mismatched_bytes"] += ans["mismatched_bytes"]
                out["errors"] += ans["failed"][: max(0, 10 - len(out["errors"]))]
                for r in ctx.check_context_transfer_status():
                    finished[r.ctx_request_id] = r.status
                if hammer is None and hconn.poll(0):
                    hammer = hconn.recv()
                if progress and out["requests"] % 2000 == 0:
                    progress(f"live: {out['requests']} real requests")
            if hammer is None and hconn.poll(600):  # the bound on pulls came first: let the hammer finish
                hammer = hconn.recv()
            deadline = time.monotonic() + 10
            while len(finished) < out["requests"] and time.monotonic() < deadline:
                for r in ctx.check_context_transfer_status(timeout_s=0.1):
                    finished[r.ctx_request_id] = r.status
                time.sleep(0.01)
            out["ctx_complete"] = sum(1 for s in finished.values() if s == "complete")
            out["ctx_pinned_at_end"] = ctx.sender.pinned
        finally:
            gconn.send(("exit", None))
            for p in (gen, ham):
                p.join(20)
                if p.is_alive():
                    p.kill()
                    p.join(5)
    out["seconds"] = round(time.monotonic() - t0, 2)
    out["hammer"] = hammer
    return out
