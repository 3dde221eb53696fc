"""The cuda_ipc copy kernel at its edges: any alignment, 1-byte and odd lengths, many tiny fragments, > 4 GiB.

Two agents in one process (the "remote" one on cuda:1 when there is one), so no IPC is involved: these
tests pin the kernel and the descriptor staging. Every check compares the WHOLE destination buffer,
including the bytes no fragment touched, against an oracle built from position-dependent data.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.agents import DescriptorList, MemoryKind, MemoryRegion, XferState
from kvbridge.errors import PeerError, RegistrationError

pytestmark = pytest.mark.cuda
TIMEOUT = 60.0


def gpu_pattern(nbytes: int, device: str, seed: int, piece: int = 1 << 28):
    """nbytes of position-dependent bytes on the GPU (every 8-byte word distinct, differing per seed).

    Made in pieces of at most `piece` bytes (no torch kernel sees more than 2**31 elements), and finished
    before returning: the agent copies on its own stream, which does not wait for torch's.
    """
    import torch

    out = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for start in range(0, nbytes, piece):
        n = min(piece, nbytes - start)
        k = torch.arange(start // 8, start // 8 + -(-n // 8), dtype=torch.int64, device=device)
        out[start:start + n] = (k * 0x9E3779B1 + (seed << 40) + 0x5DEECE66D).view(torch.uint8)[:n]
    torch.cuda.synchronize(device)
    return out


def equal_in_pieces(a, b, piece: int = 1 << 28) -> bool:
    """torch.equal over two equal-length byte tensors, a piece at a time (any device pair)."""
    import torch

    if a.numel() != b.numel():
        return False
    return all(torch.equal(a[i:i + piece], b[i:i + piece].to(a.device)) for i in range(0, a.numel(), piece))


def fragments(rng, nbytes: int, count: int, max_len: int, lens=None, mod16=None):
    """`count` disjoint ranges inside nbytes at random byte offsets, random order.

    Offsets take every alignment, or are `mod16` modulo 16 where that array is given.
    """
    slot = max_len + 32
    idx = rng.choice(nbytes // slot, size=count, replace=False).astype(np.int64)
    if lens is None:
        lens = rng.integers(1, max_len + 1, size=count).astype(np.int64)
    off = rng.integers(0, slot - lens - 15)
    if mod16 is not None:
        off = off - off % 16 + mod16
    return idx * slot + off, lens


def oracle(dst: np.ndarray, src: np.ndarray, dst_off, src_off, lens) -> np.ndarray:
    """dst with src[src_off[i]:+lens[i]] copied to dst[dst_off[i]:], vectorised (test oracle)."""
    out = dst.copy()
    starts = np.repeat(np.cumsum(lens) - lens, lens)
    within = np.arange(int(lens.sum()), dtype=np.int64) - starts
    out[np.repeat(dst_off, lens) + within] = src[np.repeat(src_off, lens) + within]
    return out


@pytest.fixture(scope="module")
def agents():
    """(local agent on cuda:0, remote agent on cuda:1 or cuda:0, remote device, peer name)."""
    import torch

    from kvbridge.agents import create_agent

    remote_dev = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    local = create_agent("cuda_ipc", "edge-local")
    remote = create_agent("cuda_ipc", "edge-remote")
    yield local, remote, remote_dev
    local.close()
    remote.close()


class Buffers:
    """A registered local (cuda:0) and remote buffer pair of position-dependent bytes."""

    def __init__(self, agents, nbytes: int) -> None:
        local, remote, remote_dev = agents
        self.local_t = gpu_pattern(nbytes, "cuda:0", seed=1)
        self.remote_t = gpu_pattern(nbytes, remote_dev, seed=2)
        self.regs = [local.register_memory(MemoryRegion.of(self.local_t)),
                     remote.register_memory(MemoryRegion.of(self.remote_t))]
        self.agent = local
        self.peer = local.connect(remote.metadata())
        self.rdev = self.remote_t.device.index

    def descs(self, side: str, offs, lens) -> DescriptorList:
        t = self.local_t if side == "local" else self.remote_t
        return DescriptorList(t.data_ptr() + np.asarray(offs, dtype=np.int64), lens, MemoryKind.VRAM,
                              t.device.index)

    def move(self, op: str, local_off, remote_off, lens) -> None:
        h = getattr(self.agent, op)(self.peer, self.descs("local", local_off, lens),
                                    self.descs("remote", remote_off, lens))
        h.wait(TIMEOUT)
        assert h.state() is XferState.DONE
        h.release()

    def release(self) -> None:
        for r in self.regs:
            r.release()


def check_read(agents, nbytes: int, dst_off, src_off, lens) -> None:
    b = Buffers(agents, nbytes)
    try:
        before, remote = b.local_t.cpu().numpy(), b.remote_t.cpu().numpy()
        b.move("read", dst_off, src_off, lens)
        np.testing.assert_array_equal(b.local_t.cpu().numpy(), oracle(before, remote, dst_off, src_off, lens))
    finally:
        b.release()


def test_every_mutual_misalignment_and_odd_length_is_byte_exact(agents):
    rng = np.random.default_rng(0)
    n = 4000
    src_off, lens = fragments(rng, 64 << 20, n, 9000)
    # every (src - dst) % 16 class appears, including the 16-byte path with odd heads and tails
    dst_off, _ = fragments(rng, 64 << 20, n, 9000, lens, mod16=(src_off + np.arange(n)) % 16)
    check_read(agents, 64 << 20, dst_off, src_off, lens)


def test_one_byte_fragments_are_byte_exact(agents):
    rng = np.random.default_rng(1)
    src_off, lens = fragments(rng, 8 << 20, 50_000, 1)
    dst_off, _ = fragments(rng, 8 << 20, 50_000, 1, lens)
    check_read(agents, 8 << 20, dst_off, src_off, lens)


def test_200k_tiny_fragments_of_mixed_lengths_are_byte_exact(agents):
    rng = np.random.default_rng(2)
    src_off, lens = fragments(rng, 32 << 20, 200_000, 64)
    dst_off, _ = fragments(rng, 32 << 20, 200_000, 64, lens)
    check_read(agents, 32 << 20, dst_off, src_off, lens)


def test_200k_equal_4k_fragments_take_the_uniform_path_byte_exact(agents):
    import torch

    rng = np.random.default_rng(3)
    n, f = 200_000, 4096
    src_blk, dst_blk = rng.permutation(n)[: n - 7], rng.permutation(n)[: n - 7]  # 7 blocks stay untouched
    b = Buffers(agents, n * f)
    try:
        want = b.local_t.clone().view(n, f)
        remote = b.remote_t.to("cuda:0").view(n, f)
        want[torch.from_numpy(dst_blk)] = remote[torch.from_numpy(src_blk)]
        torch.cuda.synchronize()
        b.move("read", dst_blk * f, src_blk * f, np.full(n - 7, f, dtype=np.int64))
        assert torch.equal(b.local_t.view(n, f), want)
    finally:
        b.release()


def test_a_grid_read_of_scattered_blocks_is_byte_exact_in_row_chunks(agents):
    """read_grid (the transceiver's direct path): 64 x 3000 ranges of 4 KiB = 192,000 ranges, more than one
    post chunk, so the grid goes out as pipelined row chunks; the whole destination is compared."""
    import torch

    from kvbridge.agents import DescriptorGrid

    rng = np.random.default_rng(9)
    rows, cols, f = 64, 3000, 4096
    n = rows * cols + 11  # 11 blocks stay untouched
    # a grid needs outer + inner sums: block ids are (row offset) + (column id), both scattered
    s_rows, d_rows = rng.permutation(rows) * cols, rng.permutation(rows) * cols
    s_cols, d_cols = rng.permutation(cols), rng.permutation(cols)
    src_blk = (s_rows[:, None] + s_cols[None, :]).ravel()
    dst_blk = (d_rows[:, None] + d_cols[None, :]).ravel()
    b = Buffers(agents, n * f)
    try:
        want = b.local_t.clone().view(n, f)
        remote = b.remote_t.to("cuda:0").view(n, f)
        want[torch.from_numpy(dst_blk)] = remote[torch.from_numpy(src_blk)]
        torch.cuda.synchronize()
        lt, rt = b.local_t, b.remote_t
        h = b.agent.read_grid(b.peer, DescriptorGrid(lt.data_ptr() + d_rows * f, d_cols * f, f, MemoryKind.VRAM, 0),
                              DescriptorGrid(rt.data_ptr() + s_rows * f, s_cols * f, f, MemoryKind.VRAM, b.rdev))
        h.wait(TIMEOUT)
        assert h.state() is XferState.DONE and h.num_descriptors == rows * cols
        h.release()
        assert torch.equal(b.local_t.view(n, f), want)
    finally:
        b.release()


def test_256_fragments_of_4_mib_are_byte_exact(agents):
    import torch

    rng = np.random.default_rng(5)
    n, f = 256, 4 << 20
    src_blk, dst_blk = rng.permutation(n), rng.permutation(n)
    b = Buffers(agents, n * f)
    try:
        want = b.local_t.clone().view(n, f)
        remote = b.remote_t.to("cuda:0").view(n, f)
        want[torch.from_numpy(dst_blk)] = remote[torch.from_numpy(src_blk)]
        torch.cuda.synchronize()
        b.move("read", dst_blk * f, src_blk * f, np.full(n, f, dtype=np.int64))
        assert torch.equal(b.local_t.view(n, f), want)
    finally:
        b.release()


def test_unaligned_write_is_byte_exact(agents):
    rng = np.random.default_rng(4)
    src_off, lens = fragments(rng, 16 << 20, 3000, 5000)
    dst_off, _ = fragments(rng, 16 << 20, 3000, 5000, lens)
    b = Buffers(agents, 16 << 20)
    try:
        local, before = b.local_t.cpu().numpy(), b.remote_t.cpu().numpy()
        b.move("write", src_off, dst_off, lens)
        np.testing.assert_array_equal(b.remote_t.cpu().numpy(), oracle(before, local, dst_off, src_off, lens))
    finally:
        b.release()


def test_single_fragment_past_4_gib_at_odd_offsets_is_byte_exact(agents):
    import torch

    length = (4 << 30) + 4099
    b = Buffers(agents, length + 64)
    try:
        # both ends at 3 mod 16: 16-byte words with a 13-byte head and odd tail, offsets past 2**32
        b.move("read", [19], [35], np.array([length], dtype=np.int64))
        got, want = b.local_t, gpu_pattern(length + 64, "cuda:0", seed=1)
        assert torch.equal(got[:19], want[:19]), "bytes before the fragment changed"
        assert torch.equal(got[19 + length:], want[19 + length:]), "bytes after the fragment changed"
        del want
        assert equal_in_pieces(got[19:19 + length], b.remote_t[35:35 + length])
    finally:
        b.release()
        torch.cuda.empty_cache()


def test_cancel_turns_failed_only_once_the_launched_kernel_has_ended(agents):
    from kvbridge.errors import TransferFailed

    b = Buffers(agents, 1 << 30)
    try:
        whole = np.array([1 << 30], dtype=np.int64)
        h = b.agent.read(b.peer, b.descs("local", [0], whole), b.descs("remote", [0], whole))
        h.cancel()  # microseconds after posting a ~3 ms copy
        assert h.error == "cancelled"
        with pytest.raises(TransferFailed, match="cancelled"):
            h.wait(TIMEOUT)
        assert h.state() is XferState.FAILED
        h.release()
        b.move("read", [0], [4096], np.array([8192], dtype=np.int64))  # the agent carries on, exact
        assert equal_in_pieces(b.local_t[:8192], b.remote_t[4096:4096 + 8192])
    finally:
        b.release()


def test_handles_released_before_done_never_lose_later_transfers(agents):
    b = Buffers(agents, 256 << 20)
    try:
        n, f = 4096, 64 << 10
        lens = np.full(n, f, dtype=np.int64)
        offs = np.arange(n, dtype=np.int64) * f
        backwards = b.descs("remote", offs[::-1].copy(), lens)
        for _ in range(6):  # released at once: their staging stays busy until their kernels end
            b.agent.read(b.peer, b.descs("local", offs, lens), backwards).release()
        b.move("read", offs, offs, lens)
        assert equal_in_pieces(b.local_t, b.remote_t)
    finally:
        b.release()


def test_remote_descriptor_past_the_peer_region_is_refused_before_launch(agents):
    b = Buffers(agents, 1 << 20)
    try:
        with pytest.raises(RegistrationError, match="remote side"):
            b.move("read", [0], [(1 << 20) - 100], np.array([101], dtype=np.int64))
        with pytest.raises(RegistrationError, match="advertised no VRAM|remote side"):
            b.agent.read(b.peer, b.descs("local", [0], [8]),
                         DescriptorList([b.remote_t.data_ptr()], [8], MemoryKind.VRAM, b.rdev + 5))
    finally:
        b.release()


def test_metadata_from_another_host_or_malformed_is_refused(agents):
    from kvbridge.agents import cuda_driver as drv
    from kvbridge.agents.envelope import seal

    local = agents[0]
    host, boot = drv.host_identity()
    with pytest.raises(PeerError, match="same host"):
        local.connect(seal("cuda_ipc", "far", {"host": "elsewhere", "boot": boot, "proc": "x",
                                               "regions": []}))
    with pytest.raises(PeerError, match="same host"):
        local.connect(seal("cuda_ipc", "far", {"host": host, "boot": "other-boot", "proc": "x",
                                               "regions": []}))
    bad = [[1 << 20, 4096, 0, "0000:00:00.0", b"short", 0]]
    with pytest.raises(PeerError, match="region 0"):
        local.connect(seal("cuda_ipc", "bad", {"host": host, "boot": boot, "proc": "x", "regions": bad}))
    with pytest.raises(PeerError, match="missing field 'host'"):
        local.connect(seal("cuda_ipc", "bad", {"regions": []}))
    with pytest.raises(PeerError, match="nixl"):
        local.connect(seal("nixl", "n", {"nixl": b""}))


def test_dram_cannot_be_registered(agents):
    buf = np.arange(1024, dtype=np.int64)
    with pytest.raises(RegistrationError, match="VRAM"):
        agents[0].register_memory(MemoryRegion.of(buf))


@pytest.mark.parametrize("grid_kernel", [True, False], ids=["grid-kernel", "staged-addresses"])
@pytest.mark.parametrize("aligned", [False, True], ids=["any-alignment", "aligned-kernel"])
def test_a_grid_read_is_byte_exact_with_either_table_and_either_kernel(agents, grid_kernel, aligned):
    """read_grid through the grid kernels (outer + inner arrays uploaded, the kernel adds them) and through the
    staged addresses: misaligned odd-length ranges on the any-alignment kernel, 16-byte ones on ALIGNED."""
    from kvbridge.agents import DescriptorGrid
    from kvbridge.agents.cuda_kernels import CopyKernel, CopyTuning

    rng = np.random.default_rng(11)
    rows, cols = 40, 50
    f, slot = (4096, 4352) if aligned else (1000, 1200)
    span = cols * slot
    s_outer, d_outer = rng.permutation(rows) * span, rng.permutation(rows) * span
    s_inner, d_inner = (rng.permutation(cols) * slot + rng.integers(0, 16, cols) * (16 if aligned else 9)
                        for _ in range(2))
    if not aligned:
        s_outer, d_outer = s_outer + 3, d_outer + 7
    b = Buffers(agents, rows * span + 4096)
    saved = b.agent.tuning
    try:
        before, remote = b.local_t.cpu().numpy(), b.remote_t.cpu().numpy()
        b.agent.grid_kernel = grid_kernel
        b.agent.tuning = CopyTuning(CopyKernel.ALIGNED if aligned else CopyKernel.ANY)
        lt, rt = b.local_t, b.remote_t
        h = b.agent.read_grid(b.peer, DescriptorGrid(lt.data_ptr() + d_outer, d_inner, f, MemoryKind.VRAM, 0),
                              DescriptorGrid(rt.data_ptr() + s_outer, s_inner, f, MemoryKind.VRAM, b.rdev))
        h.wait(TIMEOUT)
        assert h.state() is XferState.DONE and h.num_descriptors == rows * cols
        h.release()
        dst_off, src_off = ((o[:, None] + i[None, :]).ravel() for o, i in ((d_outer, d_inner), (s_outer, s_inner)))
        np.testing.assert_array_equal(b.local_t.cpu().numpy(),
                                      oracle(before, remote, dst_off, src_off, np.full(rows * cols, f)))
    finally:
        b.agent.__dict__.pop("grid_kernel", None)  # back to the class default for the module's other tests
        b.agent.tuning = saved
        b.release()
