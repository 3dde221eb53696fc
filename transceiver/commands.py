"""The commands an engine thread (or a worker) hands to a Sender's or a Receiver's I/O thread: one frozen
dataclass per call, queued by `IOThread._command` and dispatched by type on the I/O thread, which alone
changes state. Owns only these values; nothing here touches a socket, a pool or a request's state.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .params import DisaggParams

__all__ = ["CancelPull", "CancelSend", "Layers", "Publish", "Submit", "Touch"]


# --- context side (Sender) ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Publish:
    """Engine -> I/O thread: pin a request's blocks (`publish`)."""

    rid: int
    blocks: np.ndarray
    num_tokens: int
    layers_ready: int
    secret: bytes
    minted: bool  # the secret was made here, by `publish` (nobody could hold it before)


@dataclass(frozen=True)
class Layers:
    """Engine -> I/O thread: more layers are final (`mark_layers_ready`)."""

    rid: int
    layers_ready: int


@dataclass(frozen=True)
class CancelSend:
    """Engine -> I/O thread: stop serving a request (`cancel`)."""

    rid: int


# --- generation side (Receiver) ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Submit:
    """Engine -> I/O thread: start a pull (`submit`)."""

    request_id: int
    params: DisaggParams
    blocks: np.ndarray
    num_tokens: int
    timeout_s: float
    from_token: int
    withdraw: bool = False  # Receiver.withdraw: Fetch, then Done(ok=False); nothing read, nothing reported


@dataclass(frozen=True)
class CancelPull:
    """Engine -> I/O thread: abort a pull (`cancel`)."""

    request_id: int


@dataclass(frozen=True)
class Touch:
    """Worker -> I/O thread: a pull's unpack/hash finished; step it now."""

    request_id: int
