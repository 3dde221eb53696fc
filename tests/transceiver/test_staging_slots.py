"""Slots of streamed staging are never freed while a copy into or out of them may run.

The context side's SenderJobs and the generation side's Pull.release, driven directly with a real arena, real
numpy pools and a real worker thread; the pack or unpack is held on a gate (fault injection) so that the
release comes while it runs, every time.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest

from kvbridge.agents import MemoryKind
from kvbridge.formatter.layout import KVLayout, KVShape
from kvbridge.formatter.mapping import mapping_for
from kvbridge.formatter.planner import RankPool
from kvbridge.transceiver import messages as m
from kvbridge.transceiver import staging
from kvbridge.transceiver.config import TransceiverConfig
from kvbridge.transceiver.pull import Leg, Pull
from kvbridge.transceiver.send_state import Entry, EntryState
from kvbridge.transceiver.sender_work import SenderJobs
from kvbridge.transceiver.sessions import Session

LAYOUT = KVLayout(KVShape(4, 2, 16, "float16", 16))
NB = 8


@pytest.fixture
def rig(monkeypatch):
    """A context rank's SenderJobs over a numpy pool and a host arena; packs wait for `gate`."""
    buf = (np.arange(NB * LAYOUT.block_bytes(0), dtype=np.int64) % 251).astype(np.uint8)
    arena = staging.StagingArena(MemoryKind.DRAM, 0, 1 << 20, "host")
    pool = SimpleNamespace(layout=LAYOUT, rank=0, arena=arena, rank_pool=RankPool.of(LAYOUT, 0, [buf.ctypes.data], NB))
    gate, real, breaks = threading.Event(), staging.pack, []

    def gated(*a, **k):
        assert gate.wait(30), "gate never opened"
        if breaks:
            raise RuntimeError(breaks.pop())
        return real(*a, **k)

    monkeypatch.setattr(staging, "pack", gated)
    sent: list[tuple[bytes, m.Message]] = []
    worker = ThreadPoolExecutor(1)
    jobs = SenderJobs(pool, TransceiverConfig(staging_arena_bytes=1 << 20, staging_memory="host"), worker,
                      lambda ident, frame: sent.append((ident, m.decode(frame))))
    entry = Entry(7, np.array([3, 1]), 20, 1, time.monotonic() + 60)
    entry.fetched[0] = b"reader"
    entry.advance(EntryState.READING)
    yield SimpleNamespace(jobs=jobs, arena=arena, gate=gate, sent=sent, e=entry, buf=buf, breaks=breaks,
                          session=Session("gen", 0, LAYOUT))
    gate.set()
    worker.shutdown(wait=True)


def _settle(jobs: SenderJobs) -> None:
    deadline = time.monotonic() + 30
    while jobs.busy:
        assert time.monotonic() < deadline, "pack job did not finish"
        jobs.run_callbacks()
        time.sleep(0.001)


def test_a_reader_is_told_only_the_layers_packed_one_pack_at_a_time(rig):
    r = rig
    assert r.jobs.stage(b"reader", r.e, r.session)
    assert r.sent == [] and r.e.slots[0].busy  # layer 0 is being packed: nothing told yet
    r.e.layers_ready = 3
    r.jobs.pack_more(r.e)  # a pack is in flight: the next one waits for it (in order)
    r.gate.set()
    _settle(r.jobs)
    kinds = [(type(msg).__name__, msg.layers_ready) for _i, msg in r.sent]
    assert kinds == [("Blocks", 1), ("LayersReady", 3)]
    blocks = r.sent[0][1]
    slot = r.e.slots[0]
    assert (blocks.staging_addr, blocks.staging_bytes) == (slot.addr, slot.nbytes)
    # the slot holds exactly what packing the whole piece at once gives
    (piece,) = mapping_for(LAYOUT, LAYOUT).pieces(0)
    other = r.arena.alloc(slot.nbytes)
    packed = r.arena.view(slot.addr, slot.nbytes).numpy().copy()
    r.e.layers_ready = 4
    r.jobs.pack_more(r.e)
    _settle(r.jobs)
    assert [type(msg).__name__ for _i, msg in r.sent[2:]] == ["LayersReady"] and r.sent[2][1].layers_ready == 4
    staging.pack(piece, r.jobs._pool.rank_pool, r.e.blocks, 20, r.arena, other)  # (the gate is open)
    whole = r.arena.view(other, slot.nbytes).numpy()
    per = slot.nbytes // 4
    assert np.array_equal(r.arena.view(slot.addr, slot.nbytes).numpy(), whole)
    assert np.array_equal(packed[:3 * per], whole[:3 * per])  # the first three layers were right before
    r.arena.free(other)
    r.jobs.release(r.e)
    assert r.arena.in_use == 0


@pytest.mark.parametrize("how", ["reader_done", "entry_finished", "fetch_again"])
def test_a_slot_released_while_its_pack_runs_is_freed_by_the_pack_not_before(rig, how):
    r = rig
    assert r.jobs.stage(b"reader", r.e, r.session)
    held = r.arena.in_use
    assert held > 0
    if how == "reader_done":
        r.e.done[0] = False
        r.jobs.release(r.e, 0)
    elif how == "entry_finished":
        r.e.advance(EntryState.EXPIRED)
        r.jobs.release(r.e)
    else:  # the reader lost its session and fetches again: a new slot, the old one still being packed
        r.jobs.stage(b"reader", r.e, r.session)
    assert r.arena.in_use >= held  # the pack still runs: its slot is not handed out again
    r.gate.set()
    _settle(r.jobs)
    if how == "fetch_again":  # only the new slot's Blocks went out; the old slot is back in the arena
        assert [type(msg).__name__ for _i, msg in r.sent] == ["Blocks"]
        assert r.arena.in_use == held and r.sent[0][1].staging_addr == r.e.slots[0].addr
        r.jobs.release(r.e)
    else:
        assert r.sent == []  # nothing told about a slot that is gone
    assert r.arena.in_use == 0


def test_a_failed_pack_goes_direct_before_the_reader_was_told_and_fails_its_pull_after(rig):
    r = rig
    r.breaks.append("injected fault: the first pack raised")
    r.gate.set()
    assert r.jobs.stage(b"reader", r.e, r.session)
    _settle(r.jobs)
    (ident, blocks), = r.sent
    assert isinstance(blocks, m.Blocks) and blocks.staging_addr == -1 and blocks.layers_ready == 1  # direct
    assert r.arena.in_use == 0 and 0 not in r.e.slots
    # staged again (a later Fetch), told, then a later pack fails: the reader hears an Error, the slot stays
    r.sent.clear()
    assert r.jobs.stage(b"reader", r.e, r.session)
    _settle(r.jobs)
    r.breaks.append("injected fault: the second pack raised")
    r.e.layers_ready = 3
    r.jobs.pack_more(r.e)
    _settle(r.jobs)
    assert [type(msg).__name__ for _i, msg in r.sent] == ["Blocks", "Error"]
    assert r.sent[1][1].code == m.ErrorCode.INTERNAL.value and "second pack raised" in r.sent[1][1].message
    assert r.arena.in_use > 0  # the reader may still be reading layer 0 from it
    r.e.layers_ready = 4
    r.jobs.pack_more(r.e)  # nothing more is packed into a failed reader's slot
    assert not r.jobs.busy and len(r.sent) == 2
    r.e.done[0] = False
    r.jobs.release(r.e, 0)  # its Done
    assert r.arena.in_use == 0


def test_a_pull_keeps_a_slot_whose_unpack_outlives_the_drain_and_frees_it_otherwise():
    arena = staging.StagingArena(MemoryKind.DRAM, 0, 1 << 16, "host")
    (piece,) = mapping_for(LAYOUT, LAYOUT).pieces(0)
    gate = threading.Event()

    def pull_with(job) -> Pull:
        leg = Leg(0, "tcp://x", piece)
        leg.slot = arena.alloc(4096)
        leg.unpacks.append(job)
        return Pull(1, 1, "ctx", np.array([0]), 20, time.monotonic() + 5, {0: leg})

    with ThreadPoolExecutor(1) as worker:
        slow = pull_with(worker.submit(gate.wait, 30))  # an unpack still running past the drain timeout
        slow.release(arena, 0.2)
        assert arena.in_use == 4096 and slow.legs[0].slot is None  # kept (leaked), never handed out again
        gate.set()
        fast = pull_with(worker.submit(lambda: None))
        fast.release(arena, 5.0)  # waits for the unpack, then frees
        assert fast.legs[0].unpacks[0].done() and arena.in_use == 4096 and fast.legs[0].slot is None
