"""The agent conformance suite on GPU memory: local buffer on cuda:0, peer process on cuda:1.

Runs the very test functions of tests/agents/test_conformance.py (not copies) through a `pair` fixture
that puts both buffers in VRAM, for every agent that moves VRAM between GPUs of one host.
"""

from __future__ import annotations

import pytest

from ..agents import test_conformance as suite

VRAM_AGENTS = ["cuda_ipc", "nixl"]

pytestmark = [pytest.mark.cuda, pytest.mark.multigpu]

# The suite's tests, collected here a second time with this module's `pair` fixture.
globals().update({k: v for k, v in vars(suite).items() if k.startswith("test_") and callable(v)})


@pytest.fixture(params=VRAM_AGENTS, scope="module")
def pair(request):
    """(local agent with a cuda:0 buffer, that buffer, peer process with a cuda:1 buffer, peer name)."""
    yield from suite.make_pair(request.param, "cuda:0", "cuda:1")
