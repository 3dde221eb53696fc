"""Every range of a DescriptorList is checked once before anything uses it, wherever the check runs: on the
first read of its arrays (or `validate()`), in the base class before a `_post` that does not check ranges
itself, or (cuda_ipc, `checks_ranges`) in the passes each part's staging makes anyway. A bad range is refused
naming its index in the whole list, and no kernel ever gets a length or address that was not checked."""

from __future__ import annotations

import copy
from dataclasses import FrozenInstanceError

import numpy as np
import pytest
from kvbridge.agents import DescriptorList, MemoryKind, TransferAgent, create_agent
from kvbridge.errors import AgentError

from .test_cuda_ipc_stub import SIZE, Rig, _has_cuda


def test_a_list_checks_its_ranges_on_first_use_naming_the_first_bad_one():
    dl = DescriptorList(np.arange(1, 101) * 64, np.r_[np.full(60, 64), 0, np.full(39, 64)])  # made: O(1) checks
    for use in (lambda: dl.addrs, lambda: dl.lengths, dl.validate, lambda: dl.nbytes):
        with pytest.raises(AgentError, match=r"descriptor 60 is 0 bytes at 3904"):
            use()
    with pytest.raises(AgentError, match=r"descriptor 60 is 0 bytes"):  # a sub-list names the index in the whole
        dl[50:70].validate()
    dl[:60].validate()  # the good head alone is fine
    with pytest.raises(AgentError, match=r"descriptor 2 is 8 bytes at -5"):
        _ = DescriptorList([8, 16, -5], [8, 8, 8]).addrs
    with pytest.raises(AgentError, match="1-D and of equal length"):
        DescriptorList([8, 16], [8])
    good = DescriptorList([4096, 8192], [16, 16], MemoryKind.VRAM, 1)
    np.testing.assert_array_equal(good.addrs, [4096, 8192])
    assert good.validate() is good and good.nbytes == 32 and (good.kind, good.device, len(good)) == (MemoryKind.VRAM, 1, 2)
    with pytest.raises(FrozenInstanceError):
        good.device = 0
    twin = copy.deepcopy(good)
    np.testing.assert_array_equal(twin.lengths, [16, 16])
    assert (twin.kind, twin.device) == (MemoryKind.VRAM, 1)
    assert len(DescriptorList([], []).validate()) == 0


class _Recorder(TransferAgent):
    """A minimal agent that does not check ranges itself: records what `_post` was handed."""

    agent_kind = "recorder"

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.posted: list[tuple[DescriptorList, DescriptorList]] = []

    def _register(self, region, key):
        pass

    def _unregister(self, region, key):
        pass

    def _metadata(self):
        return b"x"

    def _connect(self, peer_metadata):
        return "peer"

    def _disconnect(self, peer):
        pass

    def _post(self, op, peer, local, remote):
        self.posted.append((local, remote))
        raise AgentError("recorded")


def test_an_agent_that_does_not_check_ranges_gets_only_checked_lists():
    from kvbridge.agents import MemoryRegion

    a = _Recorder("rec")
    reg = a.register_memory(MemoryRegion(4096, 1 << 20))  # kept: a dropped Registration releases itself
    a.connect(b"peer")
    local = DescriptorList([4096, 8192], [64, 64])
    with pytest.raises(AgentError, match=r"descriptor 1 is 64 bytes at -64"):
        a.read("peer", local, DescriptorList([64, -64], [64, 64]))
    assert not a.posted  # refused before the agent saw anything
    with pytest.raises(AgentError, match="recorded"):
        a.read("peer", local, DescriptorList([64, 128], [64, 64]))
    (lo, ro), = a.posted
    assert lo._checked and ro._checked
    reg.release()
    a.close()


# --- cuda_ipc (checks_ranges): through the stand-in driver ---------------------------------------------
pytestmark_stub = pytest.mark.skipif(_has_cuda(), reason="a real GPU is here: tests/gpu covers the agent on it")


@pytest.fixture
def rig():
    from kvbridge.bench import cuda_stub

    with cuda_stub.installed() as stub:
        stub.run_kernels = True
        r = Rig(stub, post_chunk=64)  # a first part of 8 descriptors, then up to 64
        try:
            yield r
        finally:
            r.close()


@pytestmark_stub
@pytest.mark.parametrize("where", [3, 150], ids=["first-part", "a-later-part"])
@pytest.mark.parametrize("bad", ["zero-length", "negative-length", "negative-local", "negative-remote"])
def test_cuda_ipc_refuses_a_bad_range_in_any_part_naming_it_and_no_kernel_gets_it(rig, where, bad):
    from kvbridge.agents.cuda_ipc import CudaIpcAgent

    assert CudaIpcAgent.checks_ranges
    n = 200
    d, s = np.arange(n) * 4096, np.arange(n)[::-1] * 4096
    lens = np.full(n, 2048)
    local, remote = rig.lists(d, s, lens)
    la, ll = local.raw()
    ra = remote.raw()[0]
    if bad == "zero-length":
        ll[where] = 0
    elif bad == "negative-length":
        ll[where] = -2048
    elif bad == "negative-local":
        la[where] = -la[where]
    else:
        ra[where] = -ra[where]
    remote = DescriptorList(ra, ll, MemoryKind.VRAM, 1)  # one lengths array for both sides, as planners do
    local = DescriptorList(la, ll, MemoryKind.VRAM, 0)
    rig.stub.launches.clear()
    with pytest.raises(AgentError, match=rf"descriptor {where}\b"):
        rig.local.read(rig.name, local, remote)
    for launch in rig.stub.launches:  # parts before the bad one may have run: only with checked ranges
        src, dst, lengths = launch.fragments()
        assert (lengths == 2048).all() and (src > 0).all() and (dst > 0).all()
    assert sum(launch.n for launch in rig.stub.launches) <= where


@pytestmark_stub
def test_cuda_ipc_reads_an_unchecked_list_exactly_and_leaves_the_check_to_its_parts(rig):
    rng = np.random.default_rng(7)
    d, s = rng.permutation(SIZE // 2048)[:300] * 2048, rng.permutation(SIZE // 2048)[:300] * 2048
    lens = rng.integers(1, 2049, 300)
    local, remote = rig.lists(d, s, lens)
    parts = rig.read(local, remote)
    assert not local._checked and not remote._checked  # no whole-list passes: each part was checked as staged
    np.testing.assert_array_equal(rig.dst, rig.expected(d, s, lens))
    np.testing.assert_array_equal(np.concatenate([p[2] for p in parts]), lens)


@pytestmark_stub
@pytest.mark.parametrize("grid_kernel", [True, False], ids=["grid-kernel", "staged-addresses"])
def test_a_grid_read_uploads_only_its_outer_and_inner_arrays_to_the_grid_kernel(grid_kernel):
    from kvbridge.bench import cuda_stub

    with cuda_stub.installed() as stub:
        stub.run_kernels = True
        rig = Rig(stub, post_chunk=64, grid_kernel=grid_kernel)
        try:
            rng = np.random.default_rng(9)
            do, so = rng.permutation(16)[:12] * (SIZE // 16), rng.permutation(16)[:12] * (SIZE // 16)  # 12 rows
            di, si = rng.permutation(32)[:10] * 2048, rng.permutation(32)[:10] * 2048  # of 10 ranges of 1 KiB
            parts = rig.read(*rig.grids(do, di, so, si, 1024), grid=True)
            d, s = (do[:, None] + di[None, :]).ravel(), (so[:, None] + si[None, :]).ravel()
            np.testing.assert_array_equal(rig.dst, rig.expected(d, s, np.full(d.size, 1024)))
            for k in range(3):  # the kernels saw exactly the list's (src, dst, length), in order
                np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]),
                                              [s + int(rig.src.ctypes.data), d + int(rig.dst.ctypes.data),
                                               np.full(d.size, 1024)][k])
            for launch in rig.stub.launches:
                rows = launch.n // 10
                if grid_kernel:
                    assert launch.name == b"kvb_grid_any" and launch.grid_rows == 10
                    assert launch.table.size == 2 * (rows + 10)  # not 2 x rows x 10 addresses
                else:
                    assert launch.name == b"kvb_copy_any" and launch.table.size == 2 * launch.n
        finally:
            rig.close()
    with pytest.raises(AgentError, match="grid_kernel must be True, False or None"):
        create_agent("cuda_ipc", "stub-bad", grid_kernel="yes")


@pytestmark_stub
def test_a_grid_launch_needs_equal_lengths_and_whole_rows():
    from kvbridge.agents import cuda_driver as drv
    from kvbridge.agents.cuda_kernels import FragmentCopier
    from kvbridge.bench import cuda_stub

    with cuda_stub.installed():
        copier = FragmentCopier.get(drv.Device.get(0))
        for n, r, flen in ((10, 3, 64), (12, 3, 0)):
            with pytest.raises(AgentError, match="a grid launch needs equal lengths and whole rows"):
                copier.launch(4096, n, n * 64, False, None, uniform=flen, grid=r)
