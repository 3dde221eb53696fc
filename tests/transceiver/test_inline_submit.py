"""A submit runs the receiver's turn on the calling thread when the I/O thread sleeps (`Receiver._inline`): the
new pull's Fetch and its read-ahead reads leave from the caller, with no wake-up of the I/O thread in between;
when the I/O thread (or another caller) holds the turn, the command waits for that turn. A real context and a
real generation transceiver in this process (ZeroMQ, NIXL); every pull ends byte-exact, the WHOLE generation
pool compared against the image it must hold (pulled blocks at their places, every other byte untouched).

    inline          one submit at a time: each Fetch is sent by the submitting thread; exact
    contended       four threads submit at once while pulls are in flight: some turns inline, some queued,
                    every pull exact, nothing left pinned or in flight
    closing         submitters racing close(): each submit either runs or raises "closed"; close returns
                    within its bound, and the transceiver's threads are gone
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvbridge.errors import KvBridgeError
from kvbridge.formatter.layout import KVLayout, KVShape
from kvbridge.formatter.verify import pool_image
from kvbridge.transceiver import CacheTransceiver, DisaggParams, TransceiverConfig
from kvbridge.transceiver import peers as P

LAY = KVLayout(KVShape(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", tokens_per_block=16))
CTX_NB, GEN_NB, N = 160, 160, 16
CFG = TransceiverConfig(agents=("nixl",), lease_s=10.0, heartbeat_s=0.5, pickup_timeout_s=30.0)


class _Req:
    def __init__(self, rid: int, blocks, params=None, num_tokens: int = N) -> None:
        self.request_id, self.block_ids, self.disagg_params = rid, np.array(blocks), params
        self.num_tokens = num_tokens


@pytest.fixture
def pair(monkeypatch):
    """(context, generation, senders): `senders` names the thread of every message a peer socket sent."""
    senders: list[str] = []
    orig = P.CtxPeers._send_parts

    def send_parts(self, endpoint, frames):
        senders.append(threading.current_thread().name)
        return orig(self, endpoint, frames)

    monkeypatch.setattr(P.CtxPeers, "_send_parts", send_parts)
    ctx_buf = pool_image(LAY, 0, CTX_NB, [([s], N, 1000 + s) for s in range(CTX_NB)], 1).copy()
    gen_buf = pool_image(LAY, 0, GEN_NB, [], 9).copy()
    with CacheTransceiver.context(ctx_buf, LAY, 0, CTX_NB, CFG) as ctx, \
            CacheTransceiver.generation(gen_buf, LAY, 0, GEN_NB, CFG) as gen:
        yield ctx, gen, gen_buf, senders


def _publish(ctx, rid: int, slot: int) -> dict:
    secret = ctx.respond_and_send_async(_Req(rid, [slot]))
    return DisaggParams(rid, ctx.instance, (ctx.endpoint,), LAY, secret, (slot,)).to_dict()


def _wait(tr, n: int, what: str) -> list:
    out, stop = [], time.monotonic() + 60
    while len(out) < n and time.monotonic() < stop:
        out += (tr.check_context_transfer_status if what == "ctx" else tr.check_gen_transfer_status)(0)
        time.sleep(0.002)
    assert len(out) == n, f"{len(out)} of {n} {what} results within 60 s"
    return out


def _exact(gen_buf, placed: dict[int, int]) -> None:
    """The generation pool holds context slot s's codes in block g for every g -> s, background elsewhere."""
    want = pool_image(LAY, 0, GEN_NB, [([g], N, 1000 + s) for g, s in placed.items()], 9)
    assert np.array_equal(gen_buf, want), "the generation pool differs from its image"


def test_a_submit_sends_its_fetch_from_the_calling_thread(pair):
    ctx, gen, gen_buf, senders = pair
    placed = {}
    for rid in range(1, 9):  # one at a time: the I/O thread sleeps between them
        gen.request_and_receive_async(_Req(rid, [rid], _publish(ctx, rid, 10 + rid)))
        (r,) = _wait(gen, 1, "gen")
        assert r.ok, r.error
        placed[rid] = 10 + rid
    assert {x.status for x in ctx.check_context_transfer_status(8, 30)} == {"complete"}
    _exact(gen_buf, placed)
    me = threading.current_thread().name
    # the first pull's Fetch waited for its session (Hello, Welcome: the I/O thread); later ones left from here
    assert senders.count(me) >= 6, senders
    assert ctx.sender.pinned == 0 and gen.receiver.in_flight == 0


def test_four_threads_submitting_at_once_pull_every_block_exactly(pair):
    ctx, gen, gen_buf, senders = pair
    gen.request_and_receive_async(_Req(100, [63], _publish(ctx, 100, 63)))  # the session, up before the race
    assert _wait(gen, 1, "gen")[0].ok and ctx.check_context_transfer_status(1, 30)
    per, threads, errors = 12, [], []
    plan = {t * per + i + 1: (t * per + i, (t * per + i) % CTX_NB) for t in range(4) for i in range(per)}
    params = {rid: _publish(ctx, rid, slot) for rid, (_g, slot) in plan.items()}

    def submit(rids):
        try:
            for rid in rids:
                gen.request_and_receive_async(_Req(rid, [plan[rid][0]], params[rid]))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    for t in range(4):
        threads.append(threading.Thread(target=submit, args=([t * per + i + 1 for i in range(per)],), name=f"sub{t}"))
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert not errors
    results = _wait(gen, len(plan), "gen")
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    assert {r.status for r in _wait(ctx, len(plan), "ctx")} == {"complete"}
    _exact(gen_buf, {63: 63, **{g: s for g, s in plan.values()}})
    assert any(s.startswith("sub") for s in senders), "no submit ran its turn inline"
    assert ctx.sender.pinned == 0 and gen.receiver.in_flight == 0


def test_submitters_racing_close_either_run_or_are_told_it_is_closed():
    ctx_buf = pool_image(LAY, 0, CTX_NB, [([s], N, 1000 + s) for s in range(CTX_NB)], 1).copy()
    gen_buf = pool_image(LAY, 0, GEN_NB, [], 9).copy()
    with CacheTransceiver.context(ctx_buf, LAY, 0, CTX_NB, CFG) as ctx:
        gen = CacheTransceiver.generation(gen_buf, LAY, 0, GEN_NB, CFG)
        params = [_publish(ctx, rid, rid % CTX_NB) for rid in range(1, 201)]
        told, other = [], []

        def submit(base):
            for i in range(base, 200, 4):
                try:
                    gen.request_and_receive_async(_Req(i + 1, [i % GEN_NB], params[i]))
                except KvBridgeError as e:
                    told.append(str(e))
                    return
                except Exception as e:  # noqa: BLE001 - reported below
                    other.append(repr(e))
                    return

        threads = [threading.Thread(target=submit, args=(b,)) for b in range(4)]
        for th in threads:
            th.start()
        time.sleep(0.01)
        t0 = time.monotonic()
        gen.close()
        assert time.monotonic() - t0 < 20
        for th in threads:
            th.join(10)
            assert not th.is_alive()
        assert not other, other
        assert all("closed" in t for t in told), told
        assert not gen.receiver._thread.is_alive()


def test_plan_arrays_of_inline_pulls_go_back_to_the_receivers_scratch_and_are_reused(pair):
    """A pull planned on the submitting thread and released on the I/O thread (its DoneAck) gives its plan
    arrays back to the one PlanScratch of the receiver, not to a thread's that never plans again: the next large
    pull reuses them (their pages are mapped already)."""
    ctx, gen, gen_buf, _senders = pair
    plans, n = gen.receiver._plans, 80 * N
    placed = {}
    for rid, first in ((1, 0), (2, 40)):  # 80 blocks into the reversed ids: no run merges, > 64 fragments
        src = list(range(first, first + 80))
        dst = src[::-1]
        secret = ctx.respond_and_send_async(_Req(rid, src, num_tokens=n))
        params = DisaggParams(rid, ctx.instance, (ctx.endpoint,), LAY, secret, tuple(src)).to_dict()
        gen.request_and_receive_async(_Req(rid, dst, params, n))
        (r,) = _wait(gen, 1, "gen")
        assert r.ok and r.fragments > 64, (r.error, r.fragments)
        assert plans.lent == 0  # every array it lent came back
        if rid == 1:
            kept = [id(b) for b in plans._free]
            assert kept, "no plan array came back to the receiver's scratch"
        placed.update(zip(dst, src))
    assert [id(b) for b in plans._free] == kept  # the second plan took them and gave them back
    _exact(gen_buf, placed)  # each block holds its context block's codes (the copy is byte for byte)
