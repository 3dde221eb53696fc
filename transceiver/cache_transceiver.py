"""CacheTransceiver: one rank's entry point, with TensorRT-LLM's method names so an engine can drive it.

    ctx = CacheTransceiver.context(buffers, layout, rank, num_blocks, config=None, instance=None)
    ctx.respond_and_send_async(req)          # req.request_id, req.block_ids, req.num_tokens
    ctx.check_context_transfer_status(...)   # -> [SendResult]: blocks of these requests may be freed here

    gen = CacheTransceiver.generation(buffers, layout, rank, num_blocks, config=None, instance=None)
    gen.request_and_receive_async(req)       # req.request_id, req.disagg_params, req.block_ids, req.num_tokens
    gen.check_gen_transfer_status(...)       # -> [ReceiveResult]

`buffers` is the rank's KV pool (one block_major tensor, or one per local layer) of `num_blocks` blocks;
`config` defaults to `TransceiverConfig()`; `instance` names this worker to its peers.

Completion is per rank; an executor of several ranks frees or starts a request only when every rank reports
it finished: the executor agrees on that (`executor/hooks.py`'s HookTally, over its own all-gather).
Every call here is non-blocking or bounded by `timeout_s`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from ..errors import DeadlineExceeded, KvBridgeError
from ..formatter.layout import KVLayout
from .config import TransceiverConfig
from .params import DisaggParams
from .pool import LocalPool
from .pull import ReceiveResult
from .receiver import Receiver
from .sender import Sender, SendResult

__all__ = ["CacheTransceiver", "agent_defaults"]


class CacheTransceiver:
    """The transceiver of one rank: a Sender (context role) or a Receiver (generation role) over its pool."""

    def __init__(self, role: str, pool: LocalPool, config: TransceiverConfig, instance: str | None = None) -> None:
        if role not in ("context", "generation"):
            raise KvBridgeError(f"role must be 'context' or 'generation', got {role!r}")
        self.role, self.pool, self.config = role, pool, config
        try:
            self.sender = Sender(pool, config, instance) if role == "context" else None
            self.receiver = Receiver(pool, config, instance) if role == "generation" else None
        except BaseException:
            pool.close()  # the agents and registrations made for this pool go with the failed transceiver
            raise

    @classmethod
    def context(cls, buffers, layout: KVLayout, rank: int, num_blocks: int, config: TransceiverConfig | None = None,
                instance: str | None = None) -> "CacheTransceiver":
        config = config or TransceiverConfig()
        return cls("context", LocalPool(layout, rank, buffers, num_blocks, agent_defaults(config)), config,
                   instance)

    @classmethod
    def generation(cls, buffers, layout: KVLayout, rank: int, num_blocks: int,
                   config: TransceiverConfig | None = None, instance: str | None = None) -> "CacheTransceiver":
        config = config or TransceiverConfig()
        return cls("generation", LocalPool(layout, rank, buffers, num_blocks, agent_defaults(config)), config,
                   instance)

    # --- context side ---------------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        """This context rank's control endpoint (peers connect here)."""
        return self._need_sender().endpoint

    @property
    def instance(self) -> str:
        return (self.sender or self.receiver).instance

    def respond_and_send_async(self, req: Any) -> bytes:
        """Pin `req`'s blocks (req.request_id, req.block_ids, req.num_tokens) until generation ranks pull them.

        Returns the request's secret (req.secret if it has one, else a fresh random one): whoever builds the
        request's DisaggParams must put it there, or no Fetch of it will be served.
        """
        return self._need_sender().publish(req.request_id, req.block_ids, req.num_tokens,
                                           getattr(req, "layers_ready", None), getattr(req, "secret", None))

    def check_context_transfer_status(self, at_least_request_num: int = 0, timeout_s: float = 0.0
                                      ) -> list[SendResult]:
        """Requests finished on this rank; waits (up to timeout_s) until at least `at_least_request_num`."""
        s = self._need_sender()
        return _collect(s, at_least_request_num, timeout_s, "context transfers")

    # --- generation side ------------------------------------------------------------------------------
    def request_and_receive_async(self, req: Any) -> None:
        """Start pulling req.disagg_params' KV into req.block_ids (first req.num_tokens tokens).

        With req.from_token > 0 (prefix reuse) the blocks already hold tokens [0, from_token): only the
        rest is read."""
        params = req.disagg_params
        if isinstance(params, dict):
            params = DisaggParams.from_dict(params)
        self._need_receiver().submit(req.request_id, params, req.block_ids, req.num_tokens,
                                     getattr(req, "timeout_s", None), int(getattr(req, "from_token", 0) or 0))

    def check_gen_transfer_status(self, at_least_request_num: int = 0, timeout_s: float = 0.0
                                  ) -> list[ReceiveResult]:
        """Pulls finished on this rank; waits (up to timeout_s) until at least `at_least_request_num`."""
        r = self._need_receiver()
        return _collect(r, at_least_request_num, timeout_s, "generation transfers")

    def cancel_request(self, req: Any) -> None:
        rid = req if isinstance(req, int) else req.request_id
        (self.sender or self.receiver).cancel(rid)

    def close(self) -> None:
        for part in (self.sender, self.receiver):
            if part is not None:
                part.close()
        self.pool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _need_sender(self) -> Sender:
        if self.sender is None:
            raise KvBridgeError("this is a generation-side transceiver; the call is for the context side")
        return self.sender

    def _need_receiver(self) -> Receiver:
        if self.receiver is None:
            raise KvBridgeError("this is a context-side transceiver; the call is for the generation side")
        return self.receiver


# A NIXL agent's progress thread runs every 0.5 ms only while peers may be reading this rank (the sender tells
# it: read_watch.py); otherwise every 5 ms, so an idle thread stops taking the GIL and a core share (~15% of a
# request's latency and throughput on the 2-core box: bench/RESULTS.md). A generation rank's agents are never
# read from, and its receiver polls every read it posts, which drives them. Options the config names win.
_AGENT_DEFAULTS = {"nixl": {"idle_progress_s": 0.005}}


def agent_defaults(config: TransceiverConfig) -> TransceiverConfig:
    """`config` with _AGENT_DEFAULTS under its own agent options (a copy; `config` is untouched)."""
    options = {kind: dict(opts) for kind, opts in config.options.items()}
    for kind, defaults in _AGENT_DEFAULTS.items():
        options[kind] = {**defaults, **options.get(kind, {})}
    return dataclasses.replace(config, options=options)


def _collect(part: Sender | Receiver, at_least: int, timeout_s: float, what: str) -> list:
    """Results of `part`; waits (woken by each result, bounded by timeout_s) until there are `at_least`."""
    out = part.poll_finished()
    deadline = time.monotonic() + max(0.0, timeout_s)
    while len(out) < at_least:
        left = deadline - time.monotonic()
        if left <= 0:
            if timeout_s > 0:
                raise DeadlineExceeded(f"{len(out)} of {at_least} {what} finished within {timeout_s:g} s")
            break
        part.wait_finished(left)
        out += part.poll_finished()
    return out
