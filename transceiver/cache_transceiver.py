"""CacheTransceiver: one rank's entry point, with TensorRT-LLM's method names so an engine can drive it.

    ctx = CacheTransceiver.context(pool_tensor, layout, rank, config, instance=...)
    ctx.respond_and_send_async(req)          # req.request_id, req.block_ids, req.num_tokens
    ctx.check_context_transfer_status(...)   # -> [SendResult]: blocks of these requests may be freed here

    gen = CacheTransceiver.generation(pool_tensor, layout, rank, config, instance=...)
    gen.request_and_receive_async(req)       # req.request_id, req.disagg_params, req.block_ids, req.num_tokens
    gen.check_gen_transfer_status(...)       # -> [ReceiveResult]

Completion is per rank; an executor of several ranks frees or starts a request only when every rank reports
it finished: `Agreement` does that given the executor's all-gather (torch.distributed or anything else).
Every call here is non-blocking or bounded by `timeout_s`.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

from ..errors import DeadlineExceeded, KvBridgeError
from ..formatter.layout import KVLayout
from .config import TransceiverConfig
from .params import DisaggParams
from .pool import LocalPool
from .pull import ReceiveResult
from .receiver import Receiver
from .sender import Sender, SendResult

__all__ = ["CacheTransceiver", "Agreement"]


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
        return cls("context", LocalPool(layout, rank, buffers, num_blocks, config), config, instance)

    @classmethod
    def generation(cls, buffers, layout: KVLayout, rank: int, num_blocks: int,
                   config: TransceiverConfig | None = None, instance: str | None = None) -> "CacheTransceiver":
        config = config or TransceiverConfig()
        return cls("generation", LocalPool(layout, rank, buffers, num_blocks, config), config, instance)

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
        return _collect(s.poll_finished, at_least_request_num, timeout_s, "context transfers")

    # --- generation side ------------------------------------------------------------------------------
    def request_and_receive_async(self, req: Any) -> None:
        """Start pulling req.disagg_params' KV into req.block_ids (first req.num_tokens tokens)."""
        params = req.disagg_params
        if isinstance(params, dict):
            params = DisaggParams.from_dict(params)
        self._need_receiver().submit(req.request_id, params, req.block_ids, req.num_tokens,
                                     getattr(req, "timeout_s", None))

    def check_gen_transfer_status(self, at_least_request_num: int = 0, timeout_s: float = 0.0
                                  ) -> list[ReceiveResult]:
        """Pulls finished on this rank; waits (up to timeout_s) until at least `at_least_request_num`."""
        r = self._need_receiver()
        return _collect(r.poll_finished, at_least_request_num, timeout_s, "generation transfers")

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


def _collect(poll: Callable[[], list], at_least: int, timeout_s: float, what: str) -> list:
    out = poll()
    deadline = time.monotonic() + max(0.0, timeout_s)
    while len(out) < at_least:
        if time.monotonic() >= deadline:
            if timeout_s > 0:
                raise DeadlineExceeded(f"{len(out)} of {at_least} {what} finished within {timeout_s:g} s")
            break
        time.sleep(0.001)
        out += poll()
    return out


class Agreement:
    """Completion agreed by all ranks of an executor.

    Each rank adds its locally finished results; `agree(all_gather)` exchanges the finished ids (all_gather
    takes this rank's list of ints, [id, ok, id, ok, ...], and returns every rank's list) and returns the results finished on EVERY
    rank, with ok only if ok everywhere (the local result is returned; `failed_elsewhere` marks the rest).
    """

    def __init__(self) -> None:
        self._local: dict[int, Any] = {}

    def add(self, results: Iterable[Any]) -> None:
        for r in results:
            rid = getattr(r, "request_id", None)
            rid = r.ctx_request_id if rid is None else rid
            self._local[rid] = r

    def agree(self, all_gather: Callable[[list[int]], list[list[int]]]) -> list[tuple[Any, bool]]:
        """[(local result, ok on every rank)] for ids finished on every rank."""
        mine = sorted(self._local)
        # flat [id, ok, id, ok, ...]: ids are 63-bit request handles, so no arithmetic that could leave int64
        tagged = [x for rid in mine for x in (rid, 1 if _ok(self._local[rid]) else 0)]
        lists = all_gather(tagged)
        done: dict[int, list[bool]] = {}
        for lst in lists:
            for rid, ok in zip(lst[0::2], lst[1::2]):
                done.setdefault(rid, []).append(bool(ok))
        out = []
        for rid in mine:
            oks = done.get(rid, [])
            if len(oks) == len(lists):
                out.append((self._local.pop(rid), all(oks)))
        return out


def _ok(r: Any) -> bool:
    if hasattr(r, "ok"):
        return bool(r.ok)
    return getattr(r, "status", "") == "complete"
