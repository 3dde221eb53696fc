"""The nccl agent on GPU memory: the whole conformance suite with the local buffer on cuda:0 and the peer
process on cuda:1. Skipped (with the reason) on machines with fewer than two GPUs.

Runs the very test functions of test_conformance.py through this module's `pair` fixture.
"""

from __future__ import annotations

import pytest

from . import test_conformance as suite

pytestmark = [pytest.mark.cuda, pytest.mark.multigpu]

# The suite's tests, collected here a second time with this module's `pair` fixture (module marks only:
# marking the shared function objects would mark the host suite too).
globals().update({k: v for k, v in vars(suite).items() if k.startswith("test_") and callable(v)})


@pytest.fixture(scope="module")
def pair():
    """(nccl agent with a cuda:0 buffer, that buffer, peer process with a cuda:1 buffer, peer name)."""
    yield from suite.make_pair("nccl", "cuda:0", "cuda:1")
