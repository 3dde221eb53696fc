"""LayerStreamer (executor/streaming.py) alone: which layer counts a rank marks ready, and when."""

from __future__ import annotations

import torch

from kvbridge.executor.streaming import LayerStreamer, supports_streaming


class _Hook:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def on_context_start(self, rid, blocks, n) -> None:
        self.calls.append(("start", rid, tuple(blocks), n))

    def on_layers_ready(self, rid, n) -> None:
        self.calls.append(("ready", rid, n))


def test_groups_of_layers_are_marked_as_written_and_the_last_one_always():
    hook = _Hook()
    s = LayerStreamer(hook, 2, 5, torch.device("cpu"))
    assert s.begin([(4, [1, 2], 20), (9, [3], 7)])
    for li in range(5):
        s.layer_done(li)
        if li == 1:  # layers 0-1 written: both requests' first group is ready before layer 2 runs
            assert hook.calls[-2:] == [("ready", 4, 2), ("ready", 9, 2)]
    s.end()
    assert hook.calls == [("start", 4, (1, 2), 20), ("start", 9, (3,), 7),
                          ("ready", 4, 2), ("ready", 9, 2), ("ready", 4, 4), ("ready", 9, 4),
                          ("ready", 4, 5), ("ready", 9, 5)]


def test_a_step_without_context_only_prefills_marks_nothing():
    hook = _Hook()
    s = LayerStreamer(hook, 1, 3, torch.device("cpu"))
    assert not s.begin([])
    for li in range(3):
        s.layer_done(li)
    s.end()
    assert hook.calls == []
    assert supports_streaming(hook) and not supports_streaming(object()) and not supports_streaming(None)
