"""The connection protocol's frames and the staging copies, without sockets: every bad field is named."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from kvbridge.agents import DescriptorList, MemoryKind
from kvbridge.agents import conn_wire as wire
from kvbridge.agents import staging
from kvbridge.errors import ProtocolError

from kvbridge.agents.conformance.peer import pattern


def _req(**kw) -> wire.Request:
    f = dict(op=wire.READ, kind=MemoryKind.DRAM, device=0, req_id=7, ndesc=3, nbytes=300)
    f.update(kw)
    return wire.Request(**f)


def test_request_and_response_round_trip():
    r = _req(op=wire.WRITE, kind=MemoryKind.VRAM, device=3)
    assert wire.Request.decode(r.encode()) == r
    e = wire.Response(wire.ERROR, 9, 12)
    assert wire.Response.decode(e.encode(), 9) == e


@pytest.mark.parametrize("field,value,match", [
    (0, b"XXXX", "bad magic"), (1, 99, "version 99"), (2, 7, "unknown op 7"), (3, 5, "memory kind code 5"),
    (6, 0, "at least one descriptor"), (6, wire.MAX_DESCRIPTORS + 1, "descriptors exceeds"),
    (7, wire.MAX_TRANSFER_BYTES + 1, "bytes exceeds"),
])
def test_bad_request_header_field_is_named(field, value, match):
    fields = list(struct.unpack("<4sHBBIQQQ", _req().encode().tobytes()))
    fields[field] = value
    with pytest.raises(ProtocolError, match=match):
        wire.Request.decode(struct.pack("<4sHBBIQQQ", *fields))


def test_truncated_header_and_foreign_response_are_refused():
    with pytest.raises(ProtocolError, match="expected"):
        wire.Request.decode(_req().encode()[:-1])
    with pytest.raises(ProtocolError, match="answers request 9, expected 10"):
        wire.Response.decode(wire.Response(wire.OK, 9).encode(), 10)
    with pytest.raises(ProtocolError, match="error text"):
        wire.Response.decode(wire.Response(wire.ERROR, 1, wire.MAX_ERROR_BYTES + 1).encode(), 1)


def test_descriptors_round_trip_and_disagreement_is_named():
    d = DescriptorList([4096, 8192, 20000], [100, 150, 50])
    got = wire.decode_descriptors(wire.encode_descriptors(d), _req())
    np.testing.assert_array_equal(got.addrs, d.addrs)
    np.testing.assert_array_equal(got.lengths, d.lengths)
    with pytest.raises(ProtocolError, match="add up to 300 bytes, the header says 301"):
        wire.decode_descriptors(wire.encode_descriptors(d), _req(nbytes=301))
    with pytest.raises(ProtocolError, match="for 4 descriptors"):
        wire.decode_descriptors(wire.encode_descriptors(d), _req(ndesc=4))
    raw = np.array([4096, -5, 8192, 100, 150, 50], dtype="<i8").view(np.uint8)
    with pytest.raises(ProtocolError, match="descriptor 1"):
        wire.decode_descriptors(raw, _req(nbytes=300))
    raw = np.array([2**63 - 50, 4096, 8192, 100, 100, 100], dtype="<i8").view(np.uint8)
    with pytest.raises(ProtocolError, match="past the end of the address space"):
        wire.decode_descriptors(raw, _req(nbytes=300))


def test_coalesce_merges_only_touching_ranges_in_order():
    a, n = staging.coalesce(np.array([100, 150, 300, 50], np.int64), np.array([50, 10, 5, 50], np.int64))
    np.testing.assert_array_equal(a, [100, 300, 50])
    np.testing.assert_array_equal(n, [60, 5, 50])


def test_window_cuts_the_concatenation_exactly():
    a, n = np.array([1000, 5000, 9000], np.int64), np.array([10, 20, 30], np.int64)
    wa, wn = staging.window(a, n, 5, 35)
    np.testing.assert_array_equal(wa, [1005, 5000, 9000])
    np.testing.assert_array_equal(wn, [5, 20, 5])


def _oracle_gather(bufs, picks):
    return np.concatenate([bufs[b][o:o + n] for b, o, n in picks])


@pytest.mark.parametrize("unit", [1, 256])
@pytest.mark.parametrize("max_rows", [staging.MAX_INDEX_ROWS, 97])  # 97: many index steps per copy
def test_gather_then_scatter_across_two_regions_is_exact(monkeypatch, unit, max_rows):
    import torch

    monkeypatch.setattr(staging, "MAX_INDEX_ROWS", max_rows)
    rng = np.random.default_rng(unit + max_rows)
    bufs = [pattern(1 << 20, 1).copy(), pattern(1 << 20, 2).copy()]
    picks = []
    for slot in rng.permutation(2 * 256)[:300]:  # disjoint 4 KiB slots in either buffer, random order
        b, s = divmod(int(slot), 256)
        n = int(rng.integers(1, 4096 // unit + 1)) * unit
        o = s * 4096 + int(rng.integers(0, (4096 - n) // unit + 1)) * unit
        picks.append((b, o, n))
    addrs = np.array([bufs[b].ctypes.data + o for b, o, _ in picks], np.int64)
    lens = np.array([n for *_, n in picks], np.int64)
    out = torch.empty(int(lens.sum()), dtype=torch.uint8)
    staging.gather(MemoryKind.DRAM, 0, addrs, lens, out)
    np.testing.assert_array_equal(out.numpy(), _oracle_gather(bufs, picks))

    dst = [np.zeros(1 << 20, np.uint8), np.zeros(1 << 20, np.uint8)]
    daddrs = np.array([dst[b].ctypes.data + o for b, o, _ in picks], np.int64)
    staging.scatter(MemoryKind.DRAM, 0, daddrs, lens, out)
    expected = [np.zeros(1 << 20, np.uint8), np.zeros(1 << 20, np.uint8)]
    for b, o, n in picks:
        expected[b][o:o + n] = bufs[b][o:o + n]
    np.testing.assert_array_equal(dst[0], expected[0])
    np.testing.assert_array_equal(dst[1], expected[1])


def test_chunks_split_a_stream_without_losing_a_byte():
    src = pattern(1 << 16, 4).copy()
    rng = np.random.default_rng(5)
    offs = rng.choice(64, 40, replace=False).astype(np.int64) * 1024
    lens = rng.integers(1, 1025, 40).astype(np.int64)
    pieces = list(staging.chunks(src.ctypes.data + offs, lens, 3000))
    assert all(nb <= 3000 for *_, nb in pieces)
    joined = np.concatenate([np.concatenate([src[a - src.ctypes.data:a - src.ctypes.data + n]
                                             for a, n in zip(pa, pn)]) for pa, pn, _ in pieces])
    np.testing.assert_array_equal(joined, np.concatenate([src[o:o + n] for o, n in zip(offs, lens)]))


@pytest.mark.cuda
def test_device_gather_then_scatter_is_exact():
    import torch

    src = torch.from_numpy(pattern(1 << 20, 6).copy()).to("cuda:0")
    dst = torch.zeros_like(src)
    rng = np.random.default_rng(0)
    offs = rng.choice(256, 100, replace=False).astype(np.int64) * 4096
    lens = rng.integers(1, 17, 100).astype(np.int64) * 256
    out = torch.empty(int(lens.sum()), dtype=torch.uint8, device="cuda:0")
    staging.gather(MemoryKind.VRAM, 0, src.data_ptr() + offs, lens, out)
    staging.scatter(MemoryKind.VRAM, 0, dst.data_ptr() + offs, lens, out)
    torch.cuda.synchronize()
    host, got = src.cpu().numpy(), dst.cpu().numpy()
    expected = np.zeros_like(host)
    for o, n in zip(offs, lens):
        expected[o:o + n] = host[o:o + n]
    np.testing.assert_array_equal(got, expected)
    gathered = np.concatenate([host[o:o + n] for o, n in zip(offs, lens)])
    np.testing.assert_array_equal(out.cpu().numpy(), gathered)
