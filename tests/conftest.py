"""Shared test setup: the repo root on sys.path (for `examples.*`), CUDA skips with a reason.

Order: every test must pass alone and in any order, so `make test` runs them shuffled (pytest-randomly, in the
test extras): the header prints `Using --randomly-seed=N`. Reproduce a run's order with
`pytest -p randomly --randomly-seed=N ...` (the same seed also reseeds `random` and numpy before each test);
run in file order with `pytest -p no:randomly`; rerun one test alone with its node id.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("UCX_LOG_LEVEL", "error")


_STOP = (signal.SIGINT, signal.SIGTERM)
_AT_A_TERMINAL = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}


def _put_back_stop_signals() -> list[str]:
    """Ctrl-C and SIGTERM back to a terminal's defaults; the names of those that were not there."""
    changed = [signal.Signals(s).name for s in _STOP if signal.getsignal(s) is not _AT_A_TERMINAL[s]]
    blocked = signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP) & set(_STOP)
    for s in _STOP:
        signal.signal(s, _AT_A_TERMINAL[s])
    return changed + [f"{signal.Signals(s).name} blocked" for s in sorted(blocked)]


@pytest.fixture(autouse=True)
def _stop_signals_as_at_a_terminal(request):
    """Each test starts with Ctrl-C and SIGTERM as a terminal's foreground command has them: children inherit an
    ignored or blocked signal, so a server a later test starts would not stop on Ctrl-C (4 tests failed that way
    in one shuffled run). A test that leaves them changed is named in a warning (checked after it and, for a
    change made outside any test, before the next), and they are put back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    changed = _put_back_stop_signals()
    if changed:
        warnings.warn(f"something before {request.node.nodeid} (not a test) left {changed} changed; put back",
                      stacklevel=1)
    yield
    changed = _put_back_stop_signals()
    if changed:
        warnings.warn(f"{request.node.nodeid} left {changed} changed (ignored/handled or blocked); put back",
                      stacklevel=1)


# Tests marked `alone` share the machine with no other test; under more than one pytest-xdist worker they
# skip, and `make test` runs them afterwards in one process. Two kinds: a test that gives this host's
# namespace a network interface (a veth end, an address): UCX in a process that starts meanwhile (another
# worker's test) advertises that address in its NIXL metadata, and once the interface is gone its peers fail
# to load that metadata ("UCX endpoint create failed", NIXL_ERR_BACKEND: seen in
# tests/executor/test_disaggregated.py while tests/serving/test_cluster_netns.py ran beside it); and a test
# whose ranks hold deadlines of a second or two (handshakes, leases): with both cores busy beside it they are
# missed (seen in tests/transceiver).
ALONE_WHY = ("alone: shares the machine with no other test (it changes this host's network interfaces, or "
             "holds 1-2 s deadlines); run apart in one process (`pytest -p no:xdist -m alone`, as `make test` "
             "does)")


def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


@pytest.hookimpl(tryfirst=True)  # after pytest-randomly's shuffle, before the hooks that sort within a module
def pytest_collection_modifyitems(config, items):
    """CUDA skips; the vLLM tests first (the longest group: its worker starts on it at once)."""
    n = _cuda_count()
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none (torch.cuda.is_available() is False)")
    skip_multi = pytest.mark.skip(reason=f"needs 2 or more CUDA GPUs; this machine has {n}")
    beside_others = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")) > 1
    skip_alone = pytest.mark.skip(reason=ALONE_WHY)
    for item in items:
        if "cuda" in item.keywords and n < 1:
            item.add_marker(skip_cuda)
        if "multigpu" in item.keywords and n < 2:
            item.add_marker(skip_multi)
        if "alone" in item.keywords and beside_others:
            item.add_marker(skip_alone)
    items.sort(key=lambda item: group_of(item.nodeid) != "vllm")  # stable: the shuffled order is kept


# `make test` runs the suite on two workers (pytest-xdist): tests that must not run beside each other share a
# group, and one worker runs a group whole, in order. The tests that start vLLM servers start at most two
# engines at a time and share them within a module (tests/vllm/conftest.py); the README's commands start
# servers on the fixed ports the docs show. Every other test is a unit of its own, given to whichever worker
# is free (tests/vllm's other modules too: they start no engine).
_VLLM_SERVERS = ("bench_vllm", "bench_vllm_cells", "bench_vllm_route", "connector_early", "connector_faults",
                 "connector_pd", "kv_aware_vllm", "launch", "serve_vllm", "vllm_kv_replay", "vllm_members")
GROUPS = {**{f"tests/vllm/test_{m}.py": "vllm" for m in _VLLM_SERVERS},
          "tests/docs/test_readme_commands.py": "readme"}

_GONE = [p for p in GROUPS if not os.path.exists(os.path.join(ROOT, p))]
if _GONE:
    raise RuntimeError(f"tests/conftest.py GROUPS names test files that do not exist: {_GONE}")


def group_of(nodeid: str) -> str | None:
    return GROUPS.get(nodeid.split("::", 1)[0])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's load-scope scheduling with GROUPS as the scopes (its own `--dist loadgroup` marks do not reach
    the scheduler under pytest 9.2, which ignores the node ids xdist rewrites)."""
    from xdist.scheduler import LoadScopeScheduling

    class Groups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid) or nodeid

    return Groups(config, log)
