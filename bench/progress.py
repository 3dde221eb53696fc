"""Progress on long benchmark runs: a tqdm bar on a terminal, nothing when tqdm is missing or output is piped."""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator


class _Silent:
    def update(self, n: int = 1) -> None:
        pass


@contextlib.contextmanager
def progress_bar(total: int, what: str) -> Iterator:
    """A bar with .update(n) counting to `total`; a silent one when stderr is not a terminal."""
    try:
        from tqdm import tqdm
    except ImportError:
        yield _Silent()
        return
    with tqdm(total=total, desc=what, leave=False, disable=not sys.stderr.isatty()) as bar:
        yield bar
