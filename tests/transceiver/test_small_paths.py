"""The per-request paths taken for short lists (issue 24, control: one-block requests) give exactly the answers
and errors of the general numpy paths: descriptor checks, region bounds, plans, block-id checks, the wire
layout's cache and the read-ahead id comparison. Each case is checked on both sides of the size limits."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.agents import DescriptorList, MemoryKind, MemoryRegion, RegionTable
from kvbridge.errors import AgentError, PlanError, ProtocolError, RegistrationError
from kvbridge.formatter import planner as P
from kvbridge.formatter.layout import KVLayout, KVShape
from kvbridge.formatter.mapping import Piece
from kvbridge.formatter.plan_few import MAX_FRAGMENTS
from kvbridge.formatter.scratch import PlanScratch
from kvbridge.transceiver import DisaggParams
from kvbridge.transceiver.send_state import Entry

SMALL, LARGE = 3, 40  # descriptors / block ids on either side of the short-list limit (16)


def _descs(n: int, base: int = 0x10000, size: int = 4096) -> DescriptorList:
    return DescriptorList(base + np.arange(n, dtype=np.int64) * size, np.full(n, size, dtype=np.int64))


@pytest.mark.parametrize("n", [SMALL, LARGE])
def test_descriptor_list_refuses_non_positive_ranges(n):
    addrs, lengths = 0x10000 + np.arange(n, dtype=np.int64) * 64, np.full(n, 64, dtype=np.int64)
    DescriptorList(addrs, lengths).validate()
    for bad_addrs, bad_lengths, bad in ((addrs, np.where(np.arange(n) == n - 1, 0, lengths), n - 1),
                                        (np.where(np.arange(n) == 1, -5, addrs), lengths, 1)):
        d = DescriptorList(bad_addrs, bad_lengths)  # ranges are checked on first use (docs/read-host-work.md)
        with pytest.raises(AgentError, match=f"positive addresses and lengths: descriptor {bad} "):
            d.validate()
        with pytest.raises(AgentError, match="positive addresses and lengths"):
            d.addrs


@pytest.mark.parametrize("n", [0, 1, SMALL, 16, 17, LARGE])
def test_as_nixl_and_nbytes_describe_the_same_ranges(n):
    d = DescriptorList(*(_descs(n).addrs, _descs(n).lengths), MemoryKind.VRAM, 3)
    rows = [tuple(int(x) for x in r) for r in np.asarray(d.as_nixl(), dtype=np.uint64).reshape(-1, 3)]
    assert rows == [(int(a), int(b), 3) for a, b in zip(d.addrs, d.lengths)]
    assert d.nbytes == 4096 * n
    if 0 < n <= 16:  # short lists go to NIXL as (addr, len, device) tuples of Python ints
        assert isinstance(d.as_nixl(), list) and all(type(x) is int for x in d.as_nixl()[0])


@pytest.mark.parametrize("n", [SMALL, LARGE])
def test_region_check_answers_and_errors_alike(n):
    t = RegionTable()
    with pytest.raises(RegistrationError, match="no DRAM memory registered"):
        t.check(_descs(n), "READ local side")
    t.add(0, MemoryRegion(0x10000, 4096 * n))
    t.add(1, MemoryRegion(0x900000, 4096))
    t.check(_descs(n), "READ local side")
    t.check(_descs(1, 0x900000), "READ local side")
    straddling = _descs(n, 0x10000 + 8)  # the last range runs 8 bytes past the region's end
    with pytest.raises(RegistrationError, match=f"descriptor {n - 1} .* outside every registered DRAM region"):
        t.check(straddling, "READ local side")
    below = DescriptorList(np.array([0x8000] * n), np.array([16] * n))
    with pytest.raises(RegistrationError, match="descriptor 0 "):
        t.check(below, "READ local side")
    with pytest.raises(RegistrationError):  # another device: nothing registered there
        t.check(DescriptorList(_descs(n).addrs, _descs(n).lengths, MemoryKind.VRAM, 0), "x")
    t.remove(0)  # deregistered: its ranges are refused at once (the cached tables are dropped)
    with pytest.raises(RegistrationError):
        t.check(_descs(n), "READ local side")


LAY = KVLayout(KVShape(3, 4, 8, "float32", 16))


def _pools(ctx_tpb: int = 0):
    ctx = P.RankPool.of(LAY, 0, [1 << 24], 64)
    if ctx_tpb:
        ctx = P.RankPool(ctx.layout, 0, ctx.addressing, tokens_per_block=ctx_tpb)
    return ctx, P.RankPool.of(LAY, 0, [1 << 30], 64)


@pytest.mark.parametrize("piece,ctx_blocks,gen_blocks,n,first,ctx_tpb", [
    (Piece(0, range(0, 1), range(0, 1)), [5], [7], 16, 0, 0),           # one block, one fragment per K/V
    (Piece(0, range(1, 3), range(1, 2)), [5], [7], 9, 0, 0),            # a partial block
    (Piece(0, range(0, 1), range(0, 4)), [5, 6, 7], [9, 10, 11], 40, 0, 0),  # adjacent ids: merged runs
    (Piece(0, range(0, 1), range(2, 3)), [5, 6], [9, 3], 30, 16, 0),    # from a later token
    (Piece(0, range(0, 1), range(0, 1)), [5, 6, 2], [9, 3], 20, 3, 8),  # other block sizes: offsets in blocks
])
def test_few_fragment_plans_equal_the_numpy_path(piece, ctx_blocks, gen_blocks, n, first, ctx_tpb):
    ctx, gen = _pools(ctx_tpb)
    got = _same_as_numpy(piece, ctx, gen, np.array(ctx_blocks), np.array(gen_blocks), n, first)
    assert 0 < len(got) <= MAX_FRAGMENTS


def _same_as_numpy(piece, ctx, gen, cb, gb, n, first):
    """plan_piece's answer, checked against the general path's arrays (`_prepare`, then `_emit`)."""
    got = P.plan_piece(piece, ctx, gen, cb, gb, n, first, PlanScratch())
    _, c, g = P._validate(ctx, gen, cb, gb, n, first)
    todo = P._prepare(piece, ctx, gen, c, g, n, first)
    want = np.empty((3, P._count(todo)), dtype=np.int64)
    P._emit(todo, want, 0)
    assert np.array_equal(got.src, want[0]) and np.array_equal(got.dst, want[1])
    assert np.array_equal(got.length, want[2]) and got.nbytes == int(want[2].sum())
    return got


def test_short_request_plans_equal_the_numpy_path_at_random():
    """Whole blocks (merged where adjacent on both sides), partial pieces, partial last blocks, later first
    tokens, ids as any integer dtype: plan_few.py's answer is the general path's, fragment for fragment."""
    rng = np.random.default_rng(24)
    ctx, gen = _pools()
    pieces = [Piece(0, range(0, 3), range(0, 4)), Piece(0, range(1, 2), range(0, 4)), Piece(0, range(0, 3), range(1, 3))]
    merged = 0
    for _ in range(400):
        nb = int(rng.integers(1, 17))
        n = int(rng.integers((nb - 1) * 16 + 1, nb * 16 + 1))
        first = 16 * int(rng.integers(0, nb))
        start = int(rng.integers(0, 64 - nb))
        cb = np.arange(start, start + nb) if rng.random() < 0.5 else rng.permutation(64)[:nb]
        gb = np.arange(nb) + int(rng.integers(0, 64 - nb)) if rng.random() < 0.5 else rng.permutation(64)[:nb]
        dt = rng.choice([np.int64, np.int32, np.uint16])
        piece = pieces[int(rng.integers(0, len(pieces)))]
        got = _same_as_numpy(piece, ctx, gen, cb.astype(dt), gb.astype(dt), n, first)
        merged += len(got) < (nb - first // 16) * 1 and piece is pieces[0]
    assert merged  # some cases merged adjacent blocks into longer runs


def test_short_request_errors_are_the_general_paths():
    ctx, gen = _pools()
    piece = Piece(0, range(0, 3), range(0, 4))
    with pytest.raises(PlanError, match="context block id 64 is outside its pool of 64 blocks"):
        P.plan_piece(piece, ctx, gen, np.array([3, 64]), np.array([1, 2]), 20, 0, PlanScratch())
    with pytest.raises(PlanError, match="generation gave 1 block ids; 2 are needed"):
        P.plan_piece(piece, ctx, gen, np.array([3, 4]), np.array([1]), 20, 0, PlanScratch())
    with pytest.raises(PlanError, match="1-D integer array"):
        P.plan_piece(piece, ctx, gen, np.array([3.0]), np.array([1]), 16, 0, PlanScratch())
    with pytest.raises(PlanError, match="first token 16 to copy is outside"):
        P.plan_piece(piece, ctx, gen, np.array([3]), np.array([1]), 16, 16, PlanScratch())


@pytest.mark.parametrize("need", [1, SMALL, LARGE])
def test_block_id_checks_name_the_bad_id(need):
    ids = np.arange(need, dtype=np.int64)
    assert np.array_equal(P._check_blocks(ids, need, need, "context"), ids)
    for bad in (need, -1):
        wrong = ids.copy()
        wrong[need // 2] = bad
        with pytest.raises(PlanError, match=f"context block id {bad} is outside its pool of {need} blocks"):
            P._check_blocks(wrong, need, need, "context")
    with pytest.raises(PlanError, match="1-D integer array"):
        P._check_blocks(ids.astype(float), need, need, "generation")
    with pytest.raises(PlanError, match="1-D integer array"):
        P._check_blocks(np.ones(need, dtype=bool), need, need, "generation")


def test_cached_token_segments_are_read_only():
    groups = P._segment_groups(40, 16, 16)
    assert groups is P._segment_groups(40, 16, 16)
    for _, starts in groups:
        with pytest.raises(ValueError):
            starts[0] = 99


def _wire(**over):
    return {**LAY.to_wire(), **over}


def test_wire_layout_cache_keeps_types_apart():
    ok = DisaggParams(1, "i", ("tcp://127.0.0.1:1",), LAY, b"s" * 16).to_dict()
    assert DisaggParams.from_dict(ok).ctx_layout.to_wire() == LAY.to_wire()
    # equal under == but not the same JSON: each parsed (and refused) on its own, never served from the cache
    for bad in (_wire(num_layers=3.0), _wire(mla=0), _wire(tp=True)):
        with pytest.raises(ProtocolError, match="layout: field .* should be"):
            DisaggParams.from_dict({**ok, "ctx_layout": bad, "layout_fingerprint": None})
    reordered = dict(reversed(list(ok["ctx_layout"].items())))
    assert DisaggParams.from_dict({**ok, "ctx_layout": reordered}).ctx_layout.to_wire() == LAY.to_wire()


@pytest.mark.parametrize("n", [1, LARGE])
def test_read_ahead_ids_must_be_exactly_the_published_ones(n):
    blocks = np.arange(10, 10 + n, dtype=np.int64)
    e = Entry(1, blocks, 16 * n, 3, 0.0, b"s" * 16, read_ahead_ok=True)
    assert e.read_ahead_refusal(blocks.copy(), False) == ""
    other = blocks.copy()
    other[-1] += 1
    assert "not the" in e.read_ahead_refusal(other, False)
    assert "not the" in e.read_ahead_refusal(blocks[:-1] if n > 1 else np.array([], dtype=np.int64), False)
