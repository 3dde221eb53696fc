"""Shared test setup: the repo root on sys.path (for `examples.*`), CUDA skips with a reason.

Order: every test must pass alone and in any order, so `make test` runs them shuffled (pytest-randomly, in the
test extras): the header prints `Using --randomly-seed=N`. Reproduce a run's order with
`pytest -p randomly --randomly-seed=N ...` (the same seed also reseeds `random` and numpy before each test);
run in file order with `pytest -p no:randomly`; rerun one test alone with its node id.
"""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("UCX_LOG_LEVEL", "error")


def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


def pytest_collection_modifyitems(config, items):
    n = _cuda_count()
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none (torch.cuda.is_available() is False)")
    skip_multi = pytest.mark.skip(reason=f"needs 2 or more CUDA GPUs; this machine has {n}")
    for item in items:
        if "cuda" in item.keywords and n < 1:
            item.add_marker(skip_cuda)
        if "multigpu" in item.keywords and n < 2:
            item.add_marker(skip_multi)
