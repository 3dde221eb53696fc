"""Fault injection for the positional KV check through serving: `python -m tests.serving.swap_worker ARGS`
is `kvbridge worker ARGS` whose ranks run tests/executor/swap_hook.py instead of the transceiver hook (a
generation rank swaps a request's first two blocks once its KV arrived: every byte there, in the wrong place).
Run from the repository root (the rank processes import the hook as tests.executor.swap_hook)."""

from __future__ import annotations

import sys

from kvbridge.serving.config import ServerSpec
from kvbridge.serving.worker import main

SWAP_HOOK = "tests.executor.swap_hook:make"
_executor_config = ServerSpec.executor_config


def _swapping(self: ServerSpec, *args, **kw):
    cfg = _executor_config(self, *args, **kw)
    cfg.rank_hook = SWAP_HOOK  # the transceiver hook's subclass: the same args, the same transfers
    return cfg


if __name__ == "__main__":
    ServerSpec.executor_config = _swapping
    sys.exit(main(sys.argv[1:]))
