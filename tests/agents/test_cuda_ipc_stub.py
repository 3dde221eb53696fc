"""The cuda_ipc agent's host side on CPU, through a stand-in CUDA driver (kvbridge.bench.cuda_stub, whose
"kernel" performs the copy its descriptor table describes): every byte of a scattered READ lands where it
should, a grid READ hands the kernel exactly the table of the same ranges as a list, long grids go out as
pipelined row chunks, the table's upload goes on its own stream and the kernel waits for it, and remote
ranges outside what the peer registered are refused naming the range."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.agents import DescriptorGrid, DescriptorList, MemoryKind, MemoryRegion, XferState, create_agent
from kvbridge.errors import AgentError, RegistrationError


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


# The stub stands in for the CUDA driver process-wide while a test runs: not next to real GPU work.
pytestmark = pytest.mark.skipif(_has_cuda(), reason="a real GPU is here: tests/gpu covers the agent on it")

SIZE = 1 << 20


class Rig:
    """A local agent (device 0) and a peer agent (device 1) in this process, each with one 1 MiB buffer."""

    def __init__(self, stub, **opts) -> None:
        self.stub = stub
        self.local, self.peer = create_agent("cuda_ipc", "stub-local", **opts), create_agent("cuda_ipc", "stub-peer")
        self.dst, self.src = stub.device_buffer(SIZE, 0), stub.device_buffer(SIZE, 1)
        self.src[:] = (np.arange(SIZE, dtype=np.int64) * 7919 + 13) % 251  # position-dependent bytes
        self.regs = [self.local.register_memory(MemoryRegion(int(self.dst.ctypes.data), SIZE, MemoryKind.VRAM, 0)),
                     self.peer.register_memory(MemoryRegion(int(self.src.ctypes.data), SIZE, MemoryKind.VRAM, 1))]
        self.name = self.local.connect(self.peer.metadata())
        self.peer.connect(self.local.metadata())

    def lists(self, dst_off, src_off, lens):
        d0, s0 = int(self.dst.ctypes.data), int(self.src.ctypes.data)
        return (DescriptorList(d0 + np.asarray(dst_off), lens, MemoryKind.VRAM, 0),
                DescriptorList(s0 + np.asarray(src_off), lens, MemoryKind.VRAM, 1))

    def grids(self, d_outer, d_inner, s_outer, s_inner, length):
        d0, s0 = int(self.dst.ctypes.data), int(self.src.ctypes.data)
        return (DescriptorGrid(d0 + np.asarray(d_outer), d_inner, length, MemoryKind.VRAM, 0),
                DescriptorGrid(s0 + np.asarray(s_outer), s_inner, length, MemoryKind.VRAM, 1))

    def read(self, local, remote, grid=False):
        self.dst[:] = 0
        self.stub.launches.clear()
        h = (self.local.read_grid if grid else self.local.read)(self.name, local, remote)
        h.wait(5.0)
        h.release()
        return [launch.fragments() for launch in self.stub.launches]

    def expected(self, dst_off, src_off, lens) -> np.ndarray:
        out = np.zeros(SIZE, dtype=np.uint8)
        for d, s, n in zip(dst_off, src_off, lens):
            out[d:d + n] = self.src[s:s + n]
        return out

    def close(self) -> None:
        for r in self.regs:
            r.release()
        self.local.close()
        self.peer.close()


@pytest.fixture(params=[True, False], ids=["side-upload", "same-stream"])
def rig(request):
    from kvbridge.bench import cuda_stub

    with cuda_stub.installed() as stub:
        stub.run_kernels = True
        r = Rig(stub, side_upload=request.param, post_chunk=64)
        try:
            yield r
        finally:
            r.close()


def _scattered(rng, n: int, frag: int):
    return rng.permutation(SIZE // frag)[:n] * frag, rng.permutation(SIZE // frag)[:n] * frag


@pytest.mark.parametrize("equal", [True, False], ids=["equal-lengths", "mixed-lengths"])
def test_a_scattered_read_moves_every_byte_and_each_kernel_gets_its_fragments(rig, equal):
    rng = np.random.default_rng(1)
    d, s = _scattered(rng, 300, 2048)
    lens = np.full(300, 2048) if equal else rng.integers(1, 2049, 300)
    parts = rig.read(*rig.lists(d, s, lens))
    np.testing.assert_array_equal(rig.dst, rig.expected(d, s, lens))
    assert len(parts) > 1  # post_chunk 64: pipelined kernels
    src = np.concatenate([p[0] for p in parts]) - int(rig.src.ctypes.data)
    dst = np.concatenate([p[1] for p in parts]) - int(rig.dst.ctypes.data)
    np.testing.assert_array_equal(src, s)
    np.testing.assert_array_equal(dst, d)
    np.testing.assert_array_equal(np.concatenate([p[2] for p in parts]), lens)


def test_a_pipelined_read_or_grid_read_is_one_handle_polled_in_order(rig):
    from kvbridge.agents.cuda_ipc import CudaIpcChunked

    rng = np.random.default_rng(2)
    d, s = _scattered(rng, 300, 2048)
    local, remote = rig.lists(d, s, np.full(300, 2048))
    for h in (rig.local.read(rig.name, local, remote),
              rig.local.read_grid(rig.name, *rig.grids(d, [0], s, [0], 2048))):
        assert isinstance(h, CudaIpcChunked) and len(h._parts) > 1
        h.wait(5.0)
        assert h.state() is XferState.DONE
        h.release()
    np.testing.assert_array_equal(rig.dst, rig.expected(d, s, np.full(300, 2048)))


def test_a_grid_read_gives_the_kernels_exactly_the_table_of_its_list(rig):
    rng = np.random.default_rng(2)
    so, do = rng.permutation(8) * (SIZE // 8), rng.permutation(8) * (SIZE // 8)  # 8 rows
    si, di = rng.permutation(32)[:20] * 1024, rng.permutation(32)[:20] * 1024  # 20 per row, 1 KiB each
    grid_parts = rig.read(*rig.grids(do, di, so, si, 1024), grid=True)
    got = rig.dst.copy()
    local, remote = rig.grids(do, di, so, si, 1024)
    list_parts = rig.read(local.to_list(), remote.to_list())
    np.testing.assert_array_equal(got, rig.dst)
    d = (do[:, None] + di[None, :]).ravel()
    s = (so[:, None] + si[None, :]).ravel()
    np.testing.assert_array_equal(got, rig.expected(d, s, np.full(d.size, 1024)))
    assert len(grid_parts) > 1  # 160 ranges, post_chunk 64: row chunks (3 rows, then 3 each)
    for k in range(3):
        np.testing.assert_array_equal(np.concatenate([p[k] for p in grid_parts]),
                                      np.concatenate([p[k] for p in list_parts]))


def test_an_agent_without_grids_reads_them_as_lists(rig):
    rig.local.grid_native = False  # the base class's path for every other agent
    rng = np.random.default_rng(3)
    so, si = np.arange(4) * (SIZE // 4), rng.permutation(64)[:16] * 4096
    parts = rig.read(*rig.grids(so[::-1], si, so, si, 4096), grid=True)
    d = (so[::-1][:, None] + si[None, :]).ravel()
    s = (so[:, None] + si[None, :]).ravel()
    np.testing.assert_array_equal(rig.dst, rig.expected(d, s, np.full(d.size, 4096)))
    assert sum(len(p[0]) for p in parts) == 64


def test_behind_a_running_copy_the_kernel_waits_for_its_own_upload_on_the_side_stream(rig):
    calls = rig.stub.calls
    lists = rig.lists([0, 8192], [4096, 0], np.array([4096, 4096]))
    before = calls["cuStreamWaitEvent"]
    parts = rig.read(*lists)
    assert len(parts) == 1 and calls["cuStreamWaitEvent"] == before  # an idle stream: upload ahead of the kernel
    rig.stub.events_pending = True  # the last kernel still runs: the next tables go up beside it
    try:
        handles = [rig.local.read(rig.name, *lists) for _ in range(2)]
    finally:
        rig.stub.events_pending = False
    for h in handles:
        h.wait(5.0)
        h.release()
    assert calls["cuStreamWaitEvent"] - before == (2 if rig.local._side_upload else 0)
    np.testing.assert_array_equal(rig.dst, rig.expected([0, 8192], [4096, 0], [4096, 4096]))


def test_a_list_a_little_over_twice_the_first_chunk_is_already_pipelined(rig):
    rng = np.random.default_rng(4)
    d, s = _scattered(rng, 16, 4096)  # post_chunk 64: a first chunk of 8; 16 go out whole, 17 in two
    assert len(rig.read(*rig.lists(d, s, np.full(16, 4096)))) == 1
    d, s = _scattered(rng, 17, 4096)
    parts = rig.read(*rig.lists(d, s, np.full(17, 4096)))
    assert [len(p[0]) for p in parts] == [8, 9]
    np.testing.assert_array_equal(rig.dst, rig.expected(d, s, np.full(17, 4096)))


def test_pipelined_parts_of_small_fragments_double_up_to_post_chunk_and_either_rule_can_be_forced(rig):
    rng = np.random.default_rng(5)
    d, s = _scattered(rng, 300, 2048)  # post_chunk 64: 8, 16, 32, then 64s, the tail of 52 as it is
    assert [len(p[0]) for p in rig.read(*rig.lists(d, s, np.full(300, 2048)))] == [8, 16, 32, 64, 64, 64, 52]
    np.testing.assert_array_equal(rig.dst, rig.expected(d, s, np.full(300, 2048)))
    do, so = rng.permutation(32)[:30] * (SIZE // 32), rng.permutation(32)[:30] * (SIZE // 32)  # 30 rows
    di, si = rng.permutation(16)[:10] * 2048, rng.permutation(16)[:10] * 2048  # of 10 ranges
    rows = rig.read(*rig.grids(do, di, so, si, 2048), grid=True)
    assert [len(p[0]) for p in rows] == [10, 20, 40, 60, 60, 60, 50]  # rows of 10: 6 rows a part at most
    gd, gs = (do[:, None] + di[None, :]).ravel(), (so[:, None] + si[None, :]).ravel()
    np.testing.assert_array_equal(rig.dst, rig.expected(gd, gs, np.full(300, 2048)))
    d16, s16 = _scattered(rng, 40, 16384)  # 16 KiB fragments: equal parts by default (8, then up to 64)
    assert [len(p[0]) for p in rig.read(*rig.lists(d16, s16, np.full(40, 16384)))] == [8, 32]
    np.testing.assert_array_equal(rig.dst, rig.expected(d16, s16, np.full(40, 16384)))
    rig.local.post_grow = True  # growing parts for any fragment size
    assert [len(p[0]) for p in rig.read(*rig.lists(d16, s16, np.full(40, 16384)))] == [8, 16, 16]
    np.testing.assert_array_equal(rig.dst, rig.expected(d16, s16, np.full(40, 16384)))
    rig.local.post_grow = False  # as before: a first part of post_chunk / 8, then post_chunk each
    assert [len(p[0]) for p in rig.read(*rig.lists(d, s, np.full(300, 2048)))] == [8, 64, 64, 64, 64, 36]
    np.testing.assert_array_equal(rig.dst, rig.expected(d, s, np.full(300, 2048)))
    with pytest.raises(AgentError, match="post_grow must be True, False or None"):
        create_agent("cuda_ipc", "stub-bad", post_grow=1)


def test_remote_ranges_outside_the_peers_memory_are_refused_naming_the_range(rig):
    local, remote = rig.grids([0], [0, 4096], [0], [0, SIZE - 100], 4096)  # the second runs past the end
    with pytest.raises(RegistrationError, match=r"descriptor 1 \(4096 bytes"):
        rig.local.read_grid(rig.name, local, remote)
    local, remote = rig.grids([0], [0, SIZE], [0], [0, 4096], 4096)  # a local range outside our buffer
    with pytest.raises(RegistrationError, match="READ local side: descriptor 1"):
        rig.local.read_grid(rig.name, local, remote)
    local, remote = rig.grids([0], [0, 4096], [0], [0, 4096], 4096)
    with pytest.raises(AgentError, match="local grid 1 x 2 of 4096 bytes, remote grid 1 x 1"):
        rig.local.read_grid(rig.name, local, DescriptorGrid(remote.outer, remote.inner[:1], 4096, MemoryKind.VRAM, 1))
    assert not rig.stub.launches or rig.dst.sum() == 0  # nothing was copied by a refused read


@pytest.mark.parametrize("outer, inner, length, why", [
    (np.zeros((2, 2)), np.zeros(2), 8, "1-D outer and inner"),
    (np.array([4096]), np.array([0]), 0, "length must be a positive int"),
    (np.array([4096]), np.array([0]), True, "length must be a positive int"),
    (np.array([-8192]), np.array([4096]), 8, r"addresses must lie in \(0, 2\*\*63\)"),
    (np.array([1 << 62]), np.array([1 << 62]), 8, r"addresses must lie in \(0, 2\*\*63\)"),
])
def test_a_bad_grid_is_refused_naming_what_is_wrong(outer, inner, length, why):
    with pytest.raises(AgentError, match=why):
        DescriptorGrid(outer, inner, length)


def test_a_grid_lists_its_ranges_row_major_and_knows_its_extremes():
    g = DescriptorGrid(np.array([1000, 100]), np.array([5, 0, 7]), 4)
    np.testing.assert_array_equal(g.to_list().addrs, [1005, 1000, 1007, 105, 100, 107])
    assert g.bounds() == (100, 1007) and len(g) == 6 and g.nbytes == 24
    np.testing.assert_array_equal(g.rows(1, 2).to_list().addrs, [105, 100, 107])


@pytest.mark.parametrize("launch_on, kernel_device", [("local", 0), ("peer", 1)])
def test_launch_on_picks_the_gpu_that_runs_the_kernel_and_every_byte_still_lands(launch_on, kernel_device):
    from kvbridge.bench import cuda_stub

    with cuda_stub.installed() as stub:
        stub.run_kernels = True
        r = Rig(stub, post_chunk=64, launch_on=launch_on)
        try:
            rng = np.random.default_rng(5)
            d, s = _scattered(rng, 300, 2048)
            lens = rng.integers(1, 2049, 300)
            parts = r.read(*r.lists(d, s, lens))
            np.testing.assert_array_equal(r.dst, r.expected(d, s, lens))
            assert len(parts) > 1 and {x.device for x in stub.launches} == {kernel_device}
            so, do = rng.permutation(8) * (SIZE // 8), rng.permutation(8) * (SIZE // 8)
            si, di = rng.permutation(32)[:20] * 1024, rng.permutation(32)[:20] * 1024
            r.read(*r.grids(do, di, so, si, 1024), grid=True)
            dd, ss = (do[:, None] + di[None, :]).ravel(), (so[:, None] + si[None, :]).ravel()
            np.testing.assert_array_equal(r.dst, r.expected(dd, ss, np.full(dd.size, 1024)))
            assert {x.device for x in stub.launches} == {kernel_device}
            assert (1, 0) in stub.peer_access or launch_on == "local"  # device 1's kernel may store into ours
        finally:
            r.close()


def test_launch_on_accepts_only_local_or_peer():
    from kvbridge.bench import cuda_stub

    with cuda_stub.installed():
        with pytest.raises(AgentError, match="launch_on must be 'local' or 'peer', got 'remote'"):
            create_agent("cuda_ipc", "bad-launch", launch_on="remote")
