"""What a frame about one request does to the leg of the pull it reached, on a generation rank: the Receiver's
table for Blocks, LayersReady, DoneAck and Error frames that name a request (receiver.py finds the pulls by
context request id and the leg by the endpoint the frame came from).

A collaborator the Receiver holds (no mixin): given the rank's staging arena and two callables (fail a pull;
reset a peer's session), it reads nothing else of the Receiver. Runs on the Receiver's I/O thread only; changes
only the leg's and pull's state through their `advance` and the `fail` callable; never sends.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..errors import TransceiverError
from . import messages as m
from .ctx_peer import CtxPeer
from .pull import Leg, LegState, Pull

log = logging.getLogger("kvbridge.transceiver.receiver")

__all__ = ["LegFrames"]


class LegFrames:
    """The handlers of frames about one request, by message type (`handlers`).

    Args:
        arena: this rank's staging arena (a context rank that went direct gets our slot back into it).
        fail: fail(pull, error_type, error) fails a pull (it drains before it is reported).
        reset: reset(peer) drops a peer's socket and session (the next use re-handshakes).
    """

    def __init__(self, arena, fail: Callable[[Pull, str, str], None], reset: Callable[[CtxPeer], None]) -> None:
        self._arena, self._fail, self._reset = arena, fail, reset
        self.handlers = {m.Blocks: self.blocks, m.LayersReady: self.layers_ready, m.DoneAck: self.done_ack,
                         m.Error: self.error}

    def blocks(self, pull: Pull, leg: Leg, peer: CtxPeer, msg: m.Blocks) -> None:
        """The context rank's block ids (and staged slot): the leg is fetched, its reads may go out."""
        if leg.state is not LegState.FETCH_SENT:
            log.warning("request %d: context rank %d sent Blocks while its leg is %s; ignored", pull.request_id,
                        leg.ctx_rank, leg.state)
            return
        if msg.num_tokens != pull.num_tokens:
            self._fail(pull, "ProtocolError", f"context rank {leg.ctx_rank} holds {msg.num_tokens} tokens of "
                       f"request {pull.ctx_request_id}, the generation side expects {pull.num_tokens}")
        leg.advance(LegState.FETCHED)
        bad = leg.take_blocks(msg, peer.welcome, self._arena)
        if bad:
            self._fail(pull, "ProtocolError", bad)

    def layers_ready(self, pull: Pull, leg: Leg, peer: CtxPeer, msg: m.LayersReady) -> None:
        leg.layers_ready = max(leg.layers_ready, msg.layers_ready)

    def done_ack(self, pull: Pull, leg: Leg, peer: CtxPeer, msg: m.DoneAck) -> None:
        """The context rank's answer to Done: the pull's KV counts only if its blocks were still pinned."""
        if leg.state is not LegState.DONE_SENT:
            log.warning("request %d: context rank %d sent DoneAck while its leg is %s; ignored", pull.request_id,
                        leg.ctx_rank, leg.state)
            return
        leg.advance(LegState.ACKED)
        peer.legs.discard((pull.request_id, leg.ctx_rank))
        if not msg.valid:
            self._fail(pull, "LeaseExpired", f"context rank {leg.ctx_rank} released request {pull.ctx_request_id} "
                       f"before the read was confirmed ({msg.reason})")
        elif not msg.intact:
            self._fail(pull, "IntegrityError", f"context rank {leg.ctx_rank}, request {pull.ctx_request_id}: "
                       f"{msg.reason}")

    def error(self, pull: Pull, leg: Leg, peer: CtxPeer, msg: m.Error) -> None:
        """The request cannot be served: fail the pull (a lost session is retried once, not for read-ahead)."""
        if msg.code == m.ErrorCode.NO_SESSION.value and not leg.retried_session and not leg.read_ahead:
            leg.retried_session = True
            if leg.state is LegState.FETCH_SENT:  # Fetch again once the new session is up
                leg.advance(LegState.NEW)
            self._reset(peer)
            return
        etype = m.ERROR_TYPES.get(msg.code, TransceiverError).__name__
        leg.refused = True
        peer.legs.discard((pull.request_id, leg.ctx_rank))
        self._fail(pull, etype, f"context rank {leg.ctx_rank} ({leg.endpoint}): {msg.message}")
