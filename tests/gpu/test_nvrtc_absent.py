"""Without cuda-bindings (the CPU test environment), asking for the fragment-copy kernel fails with an error
that says what to install, instead of an ImportError from deep inside. Where the bindings are installed,
tests/gpu/test_cuda_ipc_cpu.py compiles the kernel with NVRTC (that needs no GPU)."""

from __future__ import annotations

import importlib.util

import pytest

from kvbridge.errors import AgentError


def _bindings_installed() -> bool:
    try:
        return importlib.util.find_spec("cuda.bindings.nvrtc") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(_bindings_installed(), reason="cuda-bindings is installed: the compile itself is tested")
def test_compiling_the_kernel_without_the_bindings_names_what_to_install():
    from kvbridge.agents import cuda_kernels

    with pytest.raises(AgentError, match=r"NVRTC bindings are missing: pip install 'kvbridge\[gpu\]'"):
        cuda_kernels.compile_source((9, 0), ptx=True)
