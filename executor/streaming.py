"""Layer-wise streaming on one rank: a context-only prefill is published when its blocks are allocated, and
its layers are marked ready as the forward pass writes them (ExecutorConfig.stream_layers = N: every N local
layers, and the last one).

Owns the per-step bookkeeping between the model's per-layer callback and the rank hook's streaming calls:

    on_context_start(request_id, block_ids, num_tokens)   the request's blocks are allocated: publish it with
                                                          nothing readable (layers_ready = 0)
    on_layers_ready(request_id, layers)                   the first `layers` LOCAL layers hold the final KV of
                                                          every token of the request

A layer is final once this step's forward wrote it: a prefill runs in one step (the executor has no chunked
prefill), and with prefix reuse the cached blocks before it are complete already, so "layer L of the new
tokens is written" means "layer L of every token is written". On CPU the layer is marked right after its KV
write; on CUDA a CUDA event is recorded per group and the group is marked once the event has completed,
queried (never waited for) at the next layer; the rest is marked when the forward ends. Each PP stage marks
its own local layers. Never allocates, pins or frees blocks, and never blocks the forward pass.
"""

from __future__ import annotations

import torch

__all__ = ["LayerStreamer", "supports_streaming"]


def supports_streaming(hook) -> bool:
    """True when the rank hook takes the streaming calls (the transceiver hook does)."""
    return hook is not None and hasattr(hook, "on_context_start") and hasattr(hook, "on_layers_ready")


class LayerStreamer:
    """Marks this step's context-only prefills' layers ready as the forward pass writes them.

    Args:
        hook: the rank hook (see `supports_streaming`).
        every: mark every `every` local layers (the last layer is always marked).
        num_layers: this rank's local layers.
        device: the rank's device (CUDA: events; CPU: marks at once).
    """

    def __init__(self, hook, every: int, num_layers: int, device: torch.device) -> None:
        self.hook, self.every, self.num_layers = hook, max(1, int(every)), int(num_layers)
        self.cuda = device.type == "cuda"
        self.active: list[int] = []
        self._pending: list[tuple[object, int]] = []  # (CUDA event, layers it completes)
        self._marked = 0

    def begin(self, requests: list[tuple[int, list[int], int]]) -> bool:
        """Publish this step's context-only prefills (request_id, block ids, prompt tokens). True if any."""
        self.active, self._pending, self._marked = [rid for rid, _, _ in requests], [], 0
        for rid, blocks, num_tokens in requests:
            self.hook.on_context_start(rid, blocks, num_tokens)
        return bool(self.active)

    def layer_done(self, li: int) -> None:
        """The model wrote local layer `li`'s KV for this step (called by StageModel.forward)."""
        n = li + 1
        if not self.active or (n % self.every and n != self.num_layers):
            return
        if not self.cuda:
            self._mark(n)
            return
        ev = torch.cuda.Event()
        ev.record()
        self._pending.append((ev, n))
        self._drain(block=False)

    def end(self) -> None:
        """The forward pass ended: every local layer is written (CUDA: waits for the last event)."""
        if self.active:
            self._drain(block=True)
            self._mark(self.num_layers)
        self.active, self._pending = [], []

    def abandon(self) -> None:
        """The forward pass failed: mark nothing more (what is not marked was never written)."""
        self.active, self._pending = [], []

    def _drain(self, block: bool) -> None:
        while self._pending:
            ev, n = self._pending[0]
            if block:
                ev.synchronize()
            elif not ev.query():
                return
            self._pending.pop(0)
            self._mark(n)

    def _mark(self, n: int) -> None:
        if n <= self._marked:
            return
        self._marked = n
        for rid in self.active:
            self.hook.on_layers_ready(rid, n)
