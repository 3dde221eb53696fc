"""The file agent: whole objects to and from files, atomic, verified; corrupt or truncated files never load."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import numpy as np
import pytest

from kvbridge.agents import DescriptorList, MemoryKind, MemoryRegion, create_agent
from kvbridge.agents.file_agent import (
    HEADER_SIZE,
    FileAgent,
    file_set,
    object_addrs,
    object_path,
    read_header,
)
from kvbridge.errors import AgentError, PeerError, TransferFailed

from .procs import BLOCK, pattern, write_objects

TAG = b"test-tag"
N = 12


@pytest.fixture
def agent():
    a = FileAgent("test", io_threads=2)
    regs = []
    a.register = lambda buf: regs.append(a.register_memory(MemoryRegion.of(buf)))  # kept for the test
    yield a
    for r in regs:
        r.release()
    a.close()


def _descs(buf: np.ndarray, order) -> DescriptorList:
    idx = np.asarray(order, dtype=np.int64)
    return DescriptorList(buf.ctypes.data + idx * BLOCK, np.full(idx.shape[0], BLOCK, dtype=np.int64))


def _write(agent, root, src, names=None, tag=TAG):
    names = names or [f"obj{i:04d}" for i in range(N)]
    peer = agent.connect(file_set(root, names, tag))
    lengths = np.full(len(names), BLOCK, dtype=np.int64)
    h = agent.write(peer, _descs(src, range(len(names))), DescriptorList(object_addrs(np.arange(len(names))),
                                                                          lengths))
    h.wait(30)
    h.release()
    agent.disconnect(peer)
    return names


def _read(agent, root, dst, names, order, tag=TAG):
    """Read objects `order` (indices into names) into dst blocks 0.. in that order; raises TransferFailed."""
    peer = agent.connect(file_set(root, names, tag))
    lengths = np.full(len(order), BLOCK, dtype=np.int64)
    h = agent.read(peer, _descs(dst, range(len(order))), DescriptorList(object_addrs(order), lengths))
    try:
        h.wait(30)
    finally:
        h.release()
        agent.disconnect(peer)


def test_objects_round_trip_byte_exact_in_any_order(agent, tmp_path):
    src = pattern(N, 1)
    agent.register(src)
    dst = np.zeros_like(src)
    agent.register(dst)
    names = _write(agent, str(tmp_path), src)
    order = np.random.default_rng(0).permutation(N)
    _read(agent, str(tmp_path), dst, names, order)
    want = src.reshape(N, BLOCK)[order].reshape(-1)
    assert np.array_equal(dst, want)
    hdr = read_header(object_path(str(tmp_path), names[0]))
    assert hdr.complete and hdr.name == names[0] and hdr.payload_len == BLOCK
    assert not [p for p in tmp_path.rglob("*") if ".tmp." in p.name]


def test_an_object_may_be_tiled_by_several_descriptors(agent, tmp_path):
    src = pattern(2, 2)
    dst = np.zeros_like(src)
    agent.register(src)
    agent.register(dst)
    peer = agent.connect(file_set(str(tmp_path), ["whole"], TAG))
    half = BLOCK
    # object 0 = src block 1 then src block 0 (two descriptors, consecutive offsets)
    local = DescriptorList(src.ctypes.data + np.array([half, 0]), np.array([half, half]))
    remote = DescriptorList(object_addrs([0, 0]) + np.array([0, half]), np.array([half, half]))
    agent.write(peer, local, remote).wait(30)
    h = agent.read(peer, DescriptorList(np.array([dst.ctypes.data]), np.array([2 * half])),
                   DescriptorList(object_addrs([0]), np.array([2 * half])))
    h.wait(30)
    h.release()
    assert np.array_equal(dst[:half], src[half:]) and np.array_equal(dst[half:], src[:half])


@pytest.mark.parametrize("damage", ["truncate", "flip_payload_byte", "flip_header_byte", "extend"])
def test_a_damaged_file_fails_the_read_and_leaves_memory_untouched(agent, tmp_path, damage):
    src = pattern(N, 3)
    agent.register(src)
    dst = pattern(N, 9)  # a sentinel pattern: a failed read must not change a byte of it
    before = dst.copy()
    agent.register(dst)
    names = _write(agent, str(tmp_path), src)
    path = object_path(str(tmp_path), names[5])
    raw = bytearray(Path(path).read_bytes())
    if damage == "truncate":
        raw = raw[:HEADER_SIZE + BLOCK // 2]
    elif damage == "flip_payload_byte":
        raw[HEADER_SIZE + 12345] ^= 0x10
    elif damage == "flip_header_byte":
        raw[40] ^= 0x01  # inside the tag
    else:
        raw += b"\0" * 7
    Path(path).write_bytes(bytes(raw))
    with pytest.raises(TransferFailed) as e:
        _read(agent, str(tmp_path), dst, names, [4, 5, 6])
    assert names[5] in str(e.value)
    assert {"truncate": "truncated", "flip_payload_byte": "checksum", "flip_header_byte": "tag",
            "extend": "truncated or extended"}[damage] in str(e.value)
    assert np.array_equal(dst, before)  # the batch is placed only once every object of it verified


def test_a_missing_object_or_a_foreign_tag_fails_the_read(agent, tmp_path):
    src = pattern(N, 4)
    dst = np.zeros_like(src)
    agent.register(src)
    agent.register(dst)
    names = _write(agent, str(tmp_path), src)
    with pytest.raises(TransferFailed, match="is not in"):
        _read(agent, str(tmp_path), dst, names + ["absent"], [N])
    with pytest.raises(TransferFailed, match="misplaced or foreign"):
        _read(agent, str(tmp_path), dst, names, [0], tag=b"another-rank")
    assert not dst.any()


def test_a_failed_write_leaves_no_file(agent, tmp_path):
    src = pattern(1, 5)
    agent.register(src)
    blocker = tmp_path / "ob"  # where object "obj" would need a folder: a plain file
    blocker.write_bytes(b"x")
    peer = agent.connect(file_set(str(tmp_path), ["obj"], TAG))
    h = agent.write(peer, _descs(src, [0]), DescriptorList(object_addrs([0]), np.array([BLOCK])))
    with pytest.raises(TransferFailed):
        h.wait(30)
    h.release()
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["ob"]


def test_descriptors_must_move_objects_whole(agent, tmp_path):
    src = pattern(2, 6)
    agent.register(src)
    peer = agent.connect(file_set(str(tmp_path), ["a", "b"], TAG))
    one = np.array([BLOCK])
    with pytest.raises(AgentError, match="names no object"):
        agent.write(peer, _descs(src, [0]), DescriptorList(object_addrs([2]), one))
    with pytest.raises(AgentError, match="from offset 0"):
        agent.write(peer, _descs(src, [0]), DescriptorList(object_addrs([0]) + 8, one))
    with pytest.raises(AgentError, match="two separate runs"):
        agent.write(peer, _descs(src, [0, 1, 0]),
                    DescriptorList(object_addrs([0, 1, 0]), np.full(3, BLOCK)))


@pytest.mark.parametrize("names,tag,match", [
    (["../escape"], b"", "is not 1-64 characters"),
    (["a/b"], b"", "is not 1-64 characters"),
    (["x" * 65], b"", "is not 1-64 characters"),
    (["a", "a"], b"", "repeat"),
    (["a"], b"t" * 33, "at most 32"),
])
def test_connect_refuses_bad_file_sets(agent, tmp_path, names, tag, match):
    with pytest.raises(PeerError, match=match):
        agent.connect(file_set(str(tmp_path), names, tag))


def test_connect_refuses_another_agents_metadata(agent):
    other = FileAgent("other")
    with pytest.raises(PeerError, match="takes a file set"):
        agent.connect(other.metadata())
    other.close()
    with pytest.raises(PeerError):
        agent.connect(b"\x93\x01\x02")


def test_registry_builds_the_file_agent():
    a = create_agent("file", "from-registry")
    assert isinstance(a, FileAgent)
    a.close()


def test_two_processes_writing_the_same_objects_at_once_leave_a_readable_store(agent, tmp_path):
    names = [f"shared{i:03d}" for i in range(N)]
    ctx = mp.get_context("spawn")
    gate = tmp_path.parent / f"{tmp_path.name}.gate"  # writers pause after round 1 until it exists
    with ctx.Pool(2) as pool:
        jobs = [pool.apply_async(write_objects, (str(tmp_path), names, w, 6, TAG, str(gate))) for w in (1, 2)]
        # read while they write: every object read is complete and verified (or not there yet)
        dst = np.zeros(BLOCK, dtype=np.uint8)
        agent.register(dst)
        versions = [pattern(N, w).reshape(N, BLOCK) for w in (1, 2)]
        seen = 0
        while not all(j.ready() for j in jobs):
            for i in range(N):
                try:
                    _read(agent, str(tmp_path), dst, names, [i])
                except TransferFailed as e:
                    assert "is not in" in str(e)  # the only acceptable failure: not written yet
                    continue
                assert any(np.array_equal(dst, v[i]) for v in versions)
                seen += 1
                gate.touch()  # a complete object was read while both writers were still at work
        assert [j.get(120) for j in jobs] == [6 * N, 6 * N]
        assert seen > 0
    for i in range(N):
        _read(agent, str(tmp_path), dst, names, [i])
        assert any(np.array_equal(dst, v[i]) for v in versions)
    assert not [p for p in tmp_path.rglob("*") if ".tmp." in p.name]
    assert len(list(tmp_path.rglob("*.kvb"))) == N


@pytest.mark.cuda
def test_gpu_memory_round_trips_and_a_damaged_object_leaves_it_untouched(agent, tmp_path):
    import torch

    src = torch.from_numpy(pattern(N, 7)).cuda()
    dst = torch.zeros_like(src)
    agent.register(src)
    agent.register(dst)
    names = [f"gpu{i:03d}" for i in range(N)]
    lengths = np.full(N, BLOCK, dtype=np.int64)
    vram = {"kind": MemoryKind.VRAM, "device": src.device.index}
    peer = agent.connect(file_set(str(tmp_path), names, TAG))
    h = agent.write(peer, DescriptorList(src.data_ptr() + np.arange(N) * BLOCK, lengths, **vram),
                    DescriptorList(object_addrs(np.arange(N)), lengths))
    h.wait(60)
    h.release()
    order = np.random.default_rng(1).permutation(N)
    h = agent.read(peer, DescriptorList(dst.data_ptr() + np.arange(N) * BLOCK, lengths, **vram),
                   DescriptorList(object_addrs(order), lengths))
    h.wait(60)
    h.release()
    assert torch.equal(dst.view(N, BLOCK), src.view(N, BLOCK)[torch.from_numpy(order).cuda()])
    raw = bytearray(Path(object_path(str(tmp_path), names[0])).read_bytes())
    raw[HEADER_SIZE + 5] ^= 1
    Path(object_path(str(tmp_path), names[0])).write_bytes(bytes(raw))
    before = dst.clone()
    h = agent.read(peer, DescriptorList(np.array([dst.data_ptr()]), np.array([BLOCK]), **vram),
                   DescriptorList(object_addrs([0]), np.array([BLOCK])))
    with pytest.raises(TransferFailed, match="checksum"):
        h.wait(60)
    h.release()
    assert torch.equal(dst, before)
