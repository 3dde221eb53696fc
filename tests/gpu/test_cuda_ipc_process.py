"""cuda_ipc across processes where the exported region is a sub-range of a larger CUDA allocation.

Caching allocators (torch's) hand out pieces of bigger cudaMalloc blocks; the IPC handle is the block's,
so the region's offset inside it must travel in the metadata and be applied by the importer. A peer that
advertises more bytes than its allocation holds is refused at connect, before any kernel could fault.
"""

from __future__ import annotations

import multiprocessing as mp
import os

import numpy as np
import pytest

from kvbridge.agents import DescriptorList, MemoryKind, MemoryRegion

from .test_cuda_ipc import gpu_pattern

pytestmark = [pytest.mark.cuda, pytest.mark.multigpu]
NBYTES = (16 << 20) + 4096
OFFSET = (3 << 20) + 48


def _peer(conn, nbytes: int, offset: int) -> None:
    import torch

    from kvbridge.agents import create_agent

    big = torch.empty(nbytes + offset + 8192, dtype=torch.uint8, device="cuda:1")
    view = big[offset:offset + nbytes]
    view.copy_(gpu_pattern(nbytes, "cuda:1", seed=9))
    torch.cuda.synchronize(1)
    agent = create_agent("cuda_ipc", f"offset-peer-{os.getpid()}")
    reg = agent.register_memory(MemoryRegion.of(view))
    conn.send((agent.metadata(), view.data_ptr()))
    conn.poll(120)
    reg.release()
    agent.close()


@pytest.fixture(scope="module")
def offset_peer():
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_peer, args=(child, NBYTES, OFFSET), daemon=True)
    proc.start()
    if not conn.poll(120):
        proc.kill()
        pytest.fail("peer process did not start within 120 s")
    meta, addr = conn.recv()
    yield meta, addr
    conn.send("exit")
    proc.join(30)
    if proc.is_alive():
        proc.kill()


def test_region_inside_a_larger_allocation_is_read_byte_exact(offset_peer):
    import torch

    from kvbridge.agents import create_agent
    from kvbridge.codec import unpack

    meta, addr = offset_peer
    region = unpack(meta)["payload"]["regions"][0]
    assert region[5] >= OFFSET  # the handle is the whole block's; the offset travels beside it
    local_t = gpu_pattern(NBYTES, "cuda:0", seed=1)  # finished before the agent's stream reads it
    with create_agent("cuda_ipc", "offset-local") as agent:
        reg = agent.register_memory(MemoryRegion.of(local_t))
        peer = agent.connect(meta)
        h = agent.read(peer, DescriptorList([local_t.data_ptr()], [NBYTES], MemoryKind.VRAM, 0),
                       DescriptorList([addr], [NBYTES], MemoryKind.VRAM, 1))
        h.wait(30.0)
        h.release()
        assert torch.equal(local_t, gpu_pattern(NBYTES, "cuda:0", seed=9))
        # scattered 4 KiB reads through the same mapping land where asked
        rng = np.random.default_rng(0)
        n = NBYTES // 4096
        src, dst = rng.permutation(n) * 4096, rng.permutation(n) * 4096
        h = agent.read(peer, DescriptorList(local_t.data_ptr() + dst, np.full(n, 4096), MemoryKind.VRAM, 0),
                       DescriptorList(addr + src, np.full(n, 4096), MemoryKind.VRAM, 1))
        h.wait(30.0)
        h.release()
        remote = gpu_pattern(NBYTES, "cuda:0", seed=9)
        inv = torch.empty(n, dtype=torch.int64)  # local block d holds remote block inv[d]
        inv[torch.from_numpy(dst // 4096)] = torch.from_numpy(src // 4096)
        want = remote[: n * 4096].view(n, 4096)[inv.to("cuda:0")].view(-1)
        assert torch.equal(local_t[: n * 4096], want)
        assert torch.equal(local_t[n * 4096:], remote[n * 4096:])  # from the whole-buffer read before
        reg.release()


def test_peer_advertising_more_than_its_allocation_is_refused(offset_peer):
    from kvbridge.agents import create_agent
    from kvbridge.agents.envelope import seal
    from kvbridge.codec import unpack
    from kvbridge.errors import PeerError

    meta, _addr = offset_peer
    env = unpack(meta)
    env["payload"]["regions"][0][1] += 1 << 30
    forged = seal("cuda_ipc", env["name"], env["payload"])
    local_t = gpu_pattern(4096, "cuda:0", seed=1)
    with create_agent("cuda_ipc", "forged-local") as agent:
        reg = agent.register_memory(MemoryRegion.of(local_t))
        with pytest.raises(PeerError, match="allocation of only"):
            agent.connect(forged)
        reg.release()


@pytest.mark.parametrize("launch_on", ["peer", "local"])
def test_launch_on_peer_runs_the_kernel_on_the_peers_gpu_and_reads_and_writes_byte_exact(offset_peer, launch_on):
    """launch_on="peer": the kernel runs on cuda:1 (the peer's memory, opened there) and stores into cuda:0."""
    import torch

    from kvbridge.agents import create_agent

    meta, addr = offset_peer
    n = NBYTES // 4096
    rng = np.random.default_rng(3)
    src, dst = rng.permutation(n) * 4096, rng.permutation(n) * 4096
    local_t = gpu_pattern(NBYTES, "cuda:0", seed=1)
    with create_agent("cuda_ipc", f"launch-{launch_on}", launch_on=launch_on, post_chunk=512) as agent:
        reg = agent.register_memory(MemoryRegion.of(local_t))
        peer = agent.connect(meta)
        h = agent.read(peer, DescriptorList(local_t.data_ptr() + dst, np.full(n, 4096), MemoryKind.VRAM, 0),
                       DescriptorList(addr + src, np.full(n, 4096), MemoryKind.VRAM, 1))
        h.wait(30.0)
        h.release()
        assert sorted(agent._engines) == ([0] if launch_on == "local" else [1])
        remote = gpu_pattern(NBYTES, "cuda:0", seed=9)
        inv = torch.empty(n, dtype=torch.int64)
        inv[torch.from_numpy(dst) // 4096] = torch.from_numpy(src) // 4096
        want = remote[: n * 4096].view(n, 4096)[inv.to("cuda:0")].view(-1)
        assert torch.equal(local_t[: n * 4096], want)
        assert torch.equal(local_t[n * 4096:], gpu_pattern(NBYTES, "cuda:0", seed=1)[n * 4096:])  # untouched
        # a WRITE lands on the peer's GPU (read back to see it), then the block's bytes are put back
        mark = gpu_pattern(4096, "cuda:0", seed=11)
        probe, keep = (torch.zeros(4096, dtype=torch.uint8, device="cuda:0") for _ in range(2))
        reg2 = [agent.register_memory(MemoryRegion.of(t)) for t in (mark, probe, keep)]
        for op, t in (("read", keep), ("write", mark), ("read", probe), ("write", keep)):
            h = getattr(agent, op)(peer, DescriptorList([t.data_ptr()], [4096], MemoryKind.VRAM, 0),
                                   DescriptorList([addr + 4096 * 7], [4096], MemoryKind.VRAM, 1))
            h.wait(30.0)
            h.release()
        assert torch.equal(probe, mark) and torch.equal(keep, remote[4096 * 7:4096 * 8])
        for r in reg2 + [reg]:
            r.release()
