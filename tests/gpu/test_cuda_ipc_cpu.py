"""cuda_ipc pieces that run without a GPU: the clear refusal on CPU, the fast region check, NVRTC."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.agents import DescriptorList, MemoryKind, MemoryRegion, RegionTable
from kvbridge.agents.cuda_ipc import FastRegionTable
from kvbridge.errors import AgentError, RegistrationError


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


@pytest.mark.skipif(_has_cuda(), reason="this machine has a GPU; the refusal is for machines without one")
def test_create_agent_without_a_gpu_raises_a_clear_agent_error():
    from kvbridge.agents import create_agent

    with pytest.raises(AgentError, match="cuda_ipc agent needs"):
        create_agent("cuda_ipc", "no-gpu")


def test_fast_region_check_gives_the_same_answers_as_region_table():
    rng = np.random.default_rng(0)
    fast, slow = FastRegionTable(), RegionTable()
    starts = [1 << 20, 5 << 20, 9 << 20]
    for i, s in enumerate(starts):
        for t in (fast, slow):
            t.add(i, MemoryRegion(s, 1 << 20, MemoryKind.VRAM, 2))
    for trial in range(400):
        n = int(rng.integers(1, 50))
        base = starts[int(rng.integers(0, 3))] if trial % 2 else starts[0]
        spread = int(rng.choice([1 << 16, 1 << 20, 10 << 20]))
        addrs = base + rng.integers(-4096, spread, size=n)
        addrs = np.maximum(addrs, 1)
        lens = rng.integers(1, 8192, size=n)
        d = DescriptorList(addrs, lens, MemoryKind.VRAM, 2)
        outcomes = []
        for t in (fast, slow):
            try:
                t.check(d, "x")
                outcomes.append(True)
            except RegistrationError:
                outcomes.append(False)
        assert outcomes[0] == outcomes[1], (addrs, lens)


def test_kernel_source_compiles_with_nvrtc_where_it_is_installed():
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings is not installed ('kvbridge[gpu]')")
    from cuda.bindings import nvrtc

    from kvbridge.agents import cuda_kernels

    try:
        nvrtc.nvrtcVersion()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"NVRTC library not loadable: {e}")
    ptx = cuda_kernels.compile_source((9, 0), ptx=True).decode()
    assert ".entry kvb_copy_aligned" in ptx and ".entry kvb_copy_any" in ptx
    assert "ld.global.v2.u64" in ptx and "st.global.v2.u64" in ptx
