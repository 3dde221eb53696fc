"""The conformance suite every TransferAgent passes: the checks of `kvbridge.agents.conformance` (the same
ones `kvbridge check-agent MODULE:CLASS` runs for agent authors), one test per check and agent.

Parametrised over the agents that run here (CPU host memory). Set KVBRIDGE_CONFORMANCE_AGENTS=spec,spec to
run other agents. The tests are device-generic: tests/gpu/test_conformance_vram.py and
test_connection_nccl.py run these same functions on GPU memory through their own `pair` fixture
(`make_pair(spec, "cuda:0", "cuda:1")`).
"""

from __future__ import annotations

import os

import pytest

from kvbridge.agents.conformance import CHECKS, Pair

HOST_AGENTS = ["nixl", "examples.custom_agent:CmaAgent", "tcp", "gloo", "examples.custom_connection:UdsAgent",
               "tests.agents.chunked:ChunkedCmaAgent"]
if os.environ.get("KVBRIDGE_CONFORMANCE_AGENTS"):
    HOST_AGENTS = os.environ["KVBRIDGE_CONFORMANCE_AGENTS"].split(",")

TIMEOUT = 30.0


def make_pair(spec: str, local_device: str, peer_device: str):
    """Generator behind `pair`: yields an open conformance Pair, then tears it down."""
    pair = Pair.open(spec, local_device, peer_device, timeout=TIMEOUT)
    try:
        yield pair
    finally:
        pair.close()


@pytest.fixture(params=HOST_AGENTS, scope="module")
def pair(request):
    """A local agent with a registered buffer, connected both ways to a peer process (host memory)."""
    yield from make_pair(request.param, "cpu", "cpu")


def _test_for(check):
    def test(pair):
        pair.reset()
        check.run(pair)

    test.__name__ = "test_" + check.name.replace("-", "_")
    test.__doc__ = check.doc
    return test


for _check in CHECKS:
    globals()["test_" + _check.name.replace("-", "_")] = _test_for(_check)
del _check
