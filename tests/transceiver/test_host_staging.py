"""Staging through host memory (transceiver.staging_memory: host), streamed layer by layer.

The context rank packs each newly ready layer range of a reader's piece into its offset of the slot and only
then tells the reader (Blocks, then LayersReady); the generation rank reads each range as one descriptor and
unpacks it once its read is done. Real processes, real ZeroMQ, real agents (tcp and nixl); whole generation
pools compared byte for byte; arenas back to zero on both sides on every path.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvbridge.agents import MemoryKind
from kvbridge.errors import ServeConfigError
from kvbridge.formatter.layout import KVLayout, KVShape, ParallelSplit
from kvbridge.formatter.mapping import mapping_for
from kvbridge.formatter.planner import RankPool
from kvbridge.formatter.staging import staging_nbytes, staging_pool
from kvbridge.serving.config import parse_config
from kvbridge.transceiver.config import ConfigError, TransceiverConfig
from kvbridge.transceiver.staging import StagingArena, layer_range, pack, through_temp, unpack

from .ranks import Cluster

HOST = {"lease_s": 30.0, "heartbeat_s": 0.5, "peer_timeout_s": 30.0, "staging_arena_bytes": 4 << 20,
        "staging_memory": "host"}
NB = 16


def L(tp=1, pp=1, layers=4, tpb=16):
    return KVLayout(KVShape(layers, 4, 16, "bfloat16", tpb), ParallelSplit(tp, pp))


# --- settings ---------------------------------------------------------------------------------------------
def test_staging_memory_is_validated_by_name_and_reaches_serving():
    assert TransceiverConfig().staging_memory == "device"
    assert TransceiverConfig.from_dict({"staging_memory": "host"}).staging_memory == "host"
    with pytest.raises(ConfigError, match=r"transceiver.staging_memory must be 'device' or 'host', got 'pinned'"):
        TransceiverConfig(staging_memory="pinned")
    cfg = parse_config({"model": "seeded:tiny", "context_servers": {}, "generation_servers": {},
                        "transceiver": {"staging_arena_bytes": 1 << 20, "staging_memory": "host"}})
    assert cfg.context[0].transceiver["staging_memory"] == "host"
    # host staging streams: serving keeps layer-wise streaming on for its context servers (device staging does not)
    assert cfg.context[0].executor_config("seeded:tiny", "c", "/tmp").stream_layers > 0
    with pytest.raises(ServeConfigError, match="transceiver.staging_memory"):
        parse_config({"model": "seeded:tiny", "context_servers": {}, "generation_servers": {},
                      "transceiver": {"staging_memory": "gpu"}})


# --- the slot's layout: a layer range is one byte range ------------------------------------------------------
@pytest.mark.parametrize("first", [0, 5])
def test_a_layer_range_of_a_piece_is_one_contiguous_byte_range_of_its_slot(first):
    ctx, gen = L(tp=2, layers=5, tpb=8), L(layers=5, tpb=4)
    n = 23
    (piece, _other) = mapping_for(ctx, gen).pieces(0)
    whole = staging_nbytes(ctx, piece, n, first)
    full = staging_pool(ctx, piece, 1 << 20, n, first_token=first)
    for lo, hi in [(0, 1), (1, 3), (3, 5), (0, 5)]:
        sub, off, nb = layer_range(piece, range(lo, hi), ctx, n, first)
        assert (sub.layers, sub.heads) == (range(lo, hi), piece.heads)
        assert nb == staging_nbytes(ctx, sub, n, first) and off + nb <= whole
        # the sub-piece's staging buffer at the offset is exactly the full buffer's rows of those layers
        part = staging_pool(ctx, sub, (1 << 20) + off, n, first_token=first)
        assert np.array_equal(part.addressing.layer_base, full.addressing.layer_base[lo:hi])
    offs = [layer_range(piece, range(i, i + 1), ctx, n, first)[1:] for i in range(5)]
    assert [o for o, _ in offs] == [i * offs[0][1] for i in range(5)] and sum(b for _, b in offs) == whole


@pytest.mark.parametrize("first", [0, 9])
def test_packing_layer_ranges_at_their_offsets_equals_packing_the_whole_piece(first):
    ctx, gen = L(tp=2, pp=1, layers=4, tpb=8), L(layers=4, tpb=4)
    n = 29
    rng = np.random.default_rng(first)
    cbuf = (np.arange(NB * ctx.block_bytes(0), dtype=np.int64) * 31 + 7).astype(np.uint8)
    cp = RankPool.of(ctx, 0, [cbuf.ctypes.data], NB)
    cb = rng.permutation(NB)[:-(-n // 8)]
    (piece, _other) = mapping_for(ctx, gen).pieces(0)
    arena = StagingArena(MemoryKind.DRAM, 0, 1 << 20, "host")
    nbytes = staging_nbytes(ctx, piece, n, first)
    a, b = arena.alloc(nbytes), arena.alloc(nbytes)
    pack(piece, cp, cb, n, arena, a, first)
    for lo, hi in [(0, 1), (1, 3), (3, 4)]:  # as the layers become ready
        sub, off, _nb = layer_range(piece, range(lo, hi), ctx, n, first)
        pack(sub, cp, cb, n, arena, b + off, first)
    assert np.array_equal(arena.view(a, nbytes).numpy(), arena.view(b, nbytes).numpy())
    # unpacking range by range into a generation pool gives what unpacking the whole slot gives
    gbufs = [np.full(NB * gen.block_bytes(0), 0xEE, np.uint8) for _ in range(2)]
    gb = rng.permutation(NB)[:-(-n // 4)]
    unpack(piece, RankPool.of(gen, 0, [gbufs[0].ctypes.data], NB), gb, n, arena, a, first)
    for lo, hi in [(2, 4), (0, 2)]:
        sub, off, _nb = layer_range(piece, range(lo, hi), ctx, n, first)
        unpack(sub, RankPool.of(gen, 0, [gbufs[1].ctypes.data], NB), gb, n, arena, b + off, first)
    assert np.array_equal(gbufs[0], gbufs[1]) and (gbufs[0] != 0xEE).any()
    arena.free(a)
    arena.free(b)
    assert arena.in_use == 0


def test_copies_through_a_bounded_temporary_buffer_are_exact():
    """The path a VRAM pool takes to a host arena (gather on the device into a chunk, one copy per chunk),
    run on host memory with chunks far smaller than the copy."""
    import torch

    pool = (np.arange(1 << 16, dtype=np.int64) * 13 + 5).astype(np.uint8)
    base = pool.ctypes.data
    rng = np.random.default_rng(3)
    starts = np.sort(rng.choice(np.arange(0, (1 << 16) - 512, 512), 40, replace=False))
    addrs, lengths = base + starts.astype(np.int64), rng.choice([128, 256, 384], 40).astype(np.int64)
    want = np.concatenate([pool[s:s + n] for s, n in zip(starts, lengths)])
    slot = torch.zeros(int(lengths.sum()), dtype=torch.uint8)
    through_temp(MemoryKind.DRAM, 0, addrs, lengths, slot, True, chunk_bytes=1000)
    assert np.array_equal(slot.numpy(), want)
    back = np.zeros_like(pool)
    through_temp(MemoryKind.DRAM, 0, back.ctypes.data + starts.astype(np.int64), lengths, slot, False, chunk_bytes=768)
    assert all(np.array_equal(back[s:s + n], pool[s:s + n]) for s, n in zip(starts, lengths))
    assert int(np.count_nonzero(back)) <= int(lengths.sum())


# --- real processes ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    c = Cluster(3)
    yield c
    c.close()


def _wait(cond, what: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        time.sleep(0.01)
    return got


def _arrived(c, pull, n: int) -> list[int]:
    """Wait (bounded) until at least n layers of `pull` are in the generation pool byte for byte: those layers."""
    return _wait(lambda: (got if len(got := c.gen[0].call("arrived_layers", pull)) >= n else None),
                 f"{n} layers arrived")


def _arenas_empty(c) -> None:
    _wait(lambda: all(p.call("arena_in_use") == 0 for p in c.ctx + c.gen), "every arena slot freed")


def _start(c, rid, n=20):
    """Publish `rid` with no layer ready on every context rank, submit its pull, wait until each context
    rank handed it out; the generation blocks, tokens and salt of the pull."""
    ctx_blocks = [3, 1] if n <= 32 else [3, 1, 4]
    for p in c.ctx:
        p.call("publish_streaming", [(rid, ctx_blocks, n, rid)])
    gen_blocks = [5, 2]
    c.gen[0].call("submit", {"pulls": [[rid, c.params(rid), gen_blocks, n, rid]]})
    _wait(lambda: all(s["fetches"] >= 1 for s in c.ctx_status()), "every context rank fetched")
    return gen_blocks, n, rid


def _ready(c, rid, k):
    for p in c.ctx:
        p.call("layers_ready", (rid, k))


def _expected_layers(c, k: int) -> list[int]:
    """The generation rank's layers (global = local for a TP-only generation layout) readable once every
    context rank marked its first k local layers ready."""
    lay = c.ctx_layout
    return sorted({layer for pp in range(lay.split.pp) for layer in list(lay.stage_layers(pp))[:k]})


@pytest.mark.parametrize("agent", ["tcp", "nixl"])
@pytest.mark.parametrize("ctx", [L(), L(tp=2), L(pp=2)], ids=["tp1", "tp2", "pp2"])
def test_host_staged_layers_arrive_as_they_are_packed_and_the_pool_is_byte_exact(cluster, agent, ctx):
    c = cluster
    c.setup(ctx, L(), NB, NB, {**HOST, "agents": [agent], "stream_layers": True})
    pull = _start(c, 21)
    assert c.gen[0].call("arrived_layers", pull) == []  # nothing ready: nothing packed, nothing read
    local = ctx.local_layers(0)
    for k in range(1, local + 1):
        _ready(c, 21, k)
        # the layers packed so far arrive (read as one range each, then unpacked), the later ones do not
        want = _expected_layers(c, k)
        assert _arrived(c, pull, len(want)) == want
    (ans,) = [c.gen[0].call("collect", {"timeout": 20})]
    (r,) = ans["results"]
    assert r["ok"], r
    assert ans["mismatched_bytes"] == 0
    assert r["fragments"] == ctx.world_size * local  # one read per context rank per ready step: all staged
    assert all(s["pinned"] == 0 for s in c.wait_ctx_released())
    _arenas_empty(c)


@pytest.mark.parametrize("gen", [L(tp=2), L(pp=2)], ids=["gen_tp2", "gen_pp2"])
def test_host_staging_streams_into_split_generation_ranks_byte_exact(cluster, gen):
    c = cluster
    c.setup(L(), gen, NB, NB, {**HOST, "agents": ["nixl"], "stream_layers": True})
    rid = 31
    c.ctx[0].call("publish_streaming", [(rid, [3, 1, 4], 40, rid)])
    for p in c.gen:
        p.conn.send(("pull", {"pulls": [[rid, c.params(rid), [5, 2, 7], 40, rid]], "timeout": 30}))
    for k in range(1, 5):  # a generation PP stage's piece starts past the first layers: told without a pack
        c.ctx[0].call("layers_ready", (rid, k))
    for p in c.gen:
        _wait(lambda p=p: p.conn.poll(0), "generation rank answered", 60)
        ans = p.conn.recv()
        assert "exception" not in ans, ans
        assert all(r["ok"] for r in ans["results"]), ans["results"]
        assert ans["mismatched_bytes"] == 0
    assert all(s["pinned"] == 0 for s in c.wait_ctx_released())
    _arenas_empty(c)


def test_host_staging_with_verification_and_every_layer_ready(cluster):
    c = cluster
    c.setup(L(tp=2), L(), NB, NB, {**HOST, "agents": ["nixl"], "verify": True})
    c.publish([(41, [0, 1, 2], 40, 41), (42, [4], 7, 42)])
    (ans,) = c.pull([[41, c.params(41), [0, 1, 2], 40, 41], [42, c.params(42), [6], 7, 42]])
    assert all(r["ok"] for r in ans["results"]) and ans["mismatched_bytes"] == 0
    # host staging stages every piece, even large-fragment ones: one read per context rank
    assert all(r["fragments"] == 2 for r in ans["results"]), ans["results"]
    assert all(s["pinned"] == 0 for s in c.wait_ctx_released())
    _arenas_empty(c)


def test_a_context_cancel_during_streamed_staging_frees_every_slot(cluster):
    c = cluster
    c.setup(L(tp=2), L(), NB, NB, {**HOST, "agents": ["nixl"], "stream_layers": True})
    pull = _start(c, 51)
    _ready(c, 51, 1)
    _wait(lambda: c.gen[0].call("arrived_layers", pull) == [0], "layer 0 arrived")
    assert all(p.call("arena_in_use") > 0 for p in c.ctx + c.gen)  # slots held while streaming
    for p in c.ctx:
        p.call("cancel", 51)
    ans = c.gen[0].call("collect", {"timeout": 10})
    (r,) = ans["results"]
    assert not r["ok"] and r["error_type"] == "RequestCancelled", r
    assert ans["mismatched_bytes"] == 0
    assert all(s["pinned"] == 0 for s in c.wait_ctx_released())
    _arenas_empty(c)


def test_a_reader_failure_during_streamed_staging_frees_every_slot(cluster):
    c = cluster
    c.setup(L(tp=2), L(), NB, NB, {**HOST, "agents": ["tcp"], "stream_layers": True})
    pull = _start(c, 61)
    _ready(c, 61, 2)
    _wait(lambda: c.gen[0].call("arrived_layers", pull) == [0, 1], "layers 0-1 arrived")
    ans = c.gen[0].call("collect", {"cancel": 61, "timeout": 10})  # the generation side gives up mid-stream
    (r,) = ans["results"]
    assert not r["ok"] and r["error_type"] == "RequestCancelled", r
    assert ans["mismatched_bytes"] == 0
    _ready(c, 61, 4)  # layers ready after the reader left: nothing is packed for it
    st = c.wait_ctx_released()
    assert all(s["pinned"] == 0 for s in st)
    assert all([f for f in s["finished"] if f[0] == 61] == [(61, "failed", "a generation rank reported a failed read")]
               for s in st)
    _arenas_empty(c)
    # the same ranks serve the next request, streamed and staged, byte exact
    pull = _start(c, 62)
    _ready(c, 62, 4)
    ans = c.gen[0].call("collect", {"timeout": 20})
    assert ans["results"][0]["ok"] and ans["mismatched_bytes"] == 0
    _arenas_empty(c)


FAST = {**HOST, "agents": ["nixl"], "stream_layers": True, "lease_s": 2.0, "heartbeat_s": 0.25,
        "peer_timeout_s": 2.0, "pickup_timeout_s": 3.0, "drain_timeout_s": 1.0}


@pytest.mark.alone  # FAST: leases of 2 s (tests/conftest.py)
def test_a_killed_generation_rank_during_streamed_staging_frees_the_context_slot(cluster):
    from .ranks import RankProc

    c = cluster
    c.setup(L(), L(), NB, NB, FAST)
    pull = _start(c, 71)
    _ready(c, 71, 1)
    assert _arrived(c, pull, 1) == [0]
    c.gen[0].proc.kill()  # kill -9 mid-stream: its lease runs out on the context rank
    st = _wait(lambda: (s if (s := c.ctx_status()[0])["finished"] else None), "request 71 finished", 10)
    assert st["finished"] == [(71, "expired", "lease expired: readers stopped renewing the lease")]
    assert st["pinned"] == 0 and c.ctx[0].call("arena_in_use") == 0
    c.procs[1] = RankProc()  # (the next test's setup initialises it)


def test_a_killed_context_rank_during_streamed_staging_fails_the_pull_and_frees_its_slot(cluster):
    from .ranks import RankProc

    c = cluster
    c.setup(L(), L(), NB, NB, FAST)
    pull = _start(c, 81)
    _ready(c, 81, 2)
    assert _arrived(c, pull, 2) == [0, 1]
    c.ctx[0].proc.kill()
    ans = c.gen[0].call("collect", {"timeout": 10})
    (r,) = ans["results"]
    assert not r["ok"] and r["error_type"] == "PeerGone", r
    assert c.gen[0].call("arena_in_use") == 0
    c.procs[0] = RankProc()
