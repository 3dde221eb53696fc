"""A transceiver rank process driven by JSON lines: run with `ip netns exec NS python netns_rank.py`.

Reuses the rank logic of tests/transceiver/ranks.py (`_serve`): the test writes one JSON line per command,
`[cmd, arg]`, on our stdin and reads one JSON line per answer from our stdout. A subprocess (not a
multiprocessing spawn) because a network namespace applies at exec. Only our own test talks on these pipes.
The protocol uses a private copy of the original stdout; fd 1 is pointed at stderr so that library output
(UCX, NIXL) can never corrupt a frame.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class LineConn:
    """The part of a multiprocessing Connection that `_serve` uses (poll/recv/send), over JSON lines."""

    def __init__(self, rx, tx) -> None:
        self._tx = tx
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, args=(rx,), daemon=True).start()
        self._next = None

    def _read(self, rx) -> None:
        for line in rx:
            self._lines.put(line)
        self._lines.put(None)  # EOF: the test is gone

    def poll(self, timeout: float) -> bool:
        if self._next is None:
            try:
                self._next = self._lines.get(timeout=timeout)
            except queue.Empty:
                return False
        return True

    def recv(self):
        if not self.poll(300):
            raise EOFError("nothing arrived within 300 s")
        line, self._next = self._next, None
        if line is None:
            raise EOFError("the other side closed the pipe")
        return json.loads(line)

    def send(self, obj) -> None:
        self._tx.write(json.dumps(obj, default=_plain) + "\n")
        self._tx.flush()


def _plain(o):
    import numpy as np

    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    raise TypeError(f"cannot send {type(o).__name__} to the test")


def main() -> None:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from tests.transceiver.ranks import _serve

    try:
        _serve(LineConn(sys.stdin, proto))
    except EOFError:
        pass


if __name__ == "__main__":
    main()
