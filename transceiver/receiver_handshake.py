"""The generation rank's first step of a pull, the handshake: a session with every context rank, a Fetch to each,
and the reads of each leg posted as its block ids are known (at once for a read-ahead leg, whose reads go out
before its Fetch; that Fetch carries the leg's Done when the reads settled as posted).

A collaborator the Receiver holds (no mixin): given the rank's pool, config, context peers, staging policy and
two callables (fail a pull; whether the `before_confirm` test hook is set), it reads nothing else of the
Receiver. Runs on whichever thread holds the Receiver's turn lock (its I/O thread, or a submitter's turn); it
changes only the pull's and its legs' state and queues frames on the peers (sent at the turn's end).
"""

from __future__ import annotations

from collections.abc import Callable

from ..agents import XferState
from . import messages as m
from .config import TransceiverConfig
from .ctx_peer import CtxPeer, PeerState
from .peers import CtxPeers
from .pool import LocalPool
from .pull import Leg, LegState, Pull, PullState
from .receiver_work import StagingPolicy

__all__ = ["Handshake"]


class Handshake:
    """The Receiver's step for pulls in PullState.HANDSHAKE (`step`).

    Args:
        pool: this generation rank's pool (its rank, rank pool and agents).
        config: handshake_timeout_s, stream_layers, verify.
        peers: the rank's context peers (sessions, sockets, the turn's outbox).
        staging: decides per leg between the staged and the direct path.
        fail: fail(pull, error_type, error) fails a pull (it drains before it is reported).
        hooked: whether the Receiver's `before_confirm` test hook is set (no Done rides on a Fetch then).
    """

    def __init__(self, pool: LocalPool, config: TransceiverConfig, peers: CtxPeers, staging: StagingPolicy,
                 fail: Callable[[Pull, str, str], None], hooked: Callable[[], bool]) -> None:
        self.pool, self.config, self._peers, self._staging = pool, config, peers, staging
        self._fail, self._hooked = fail, hooked

    def step(self, pull: Pull, now: float) -> bool:
        """Sessions up, a Fetch to every context rank, reads posted as each rank's block ids arrive."""
        for leg in pull.legs.values():
            peer = self._peers.ensure(leg.endpoint, now)
            if peer.state is PeerState.FAILED:
                self._fail(pull, *peer.error)
                return True
            if peer.state is PeerState.HELLO and now - peer.first_hello > self.config.handshake_timeout_s:
                self._fail(pull, "PeerGone", f"context rank at {leg.endpoint} did not answer hello within "
                           f"{self.config.handshake_timeout_s:g} s")
                return True
            if peer.state is PeerState.READY and leg.state is LegState.NEW and self._send_fetch(pull, leg, peer, now):
                return True
            if leg.fetched and not leg.handles and not pull.withdraw:  # reads now; others may still be fetching
                pull.mark("fetched")
                pull.post_ready_layers(leg, self.pool.rank_pool, self.pool.agents[leg.agent_kind])
        if pull.withdraw and all(leg.state in (LegState.FETCH_SENT, LegState.FETCHED) for leg in pull.legs.values()):
            self._fail(pull, "RequestCancelled", "withdrawn: the request was aborted before its pull")
            return True  # every context rank has our Fetch: the drain sends each its Done(ok=False)
        if all(leg.fetched for leg in pull.legs.values()):
            pull.advance(PullState.READ)
        return False

    def _send_fetch(self, pull: Pull, leg: Leg, peer: CtxPeer, now: float) -> bool:
        """Ask `peer` for this leg's block ids; True (the pull failed) when the context executor restarted."""
        if peer.welcome.ctx_instance != pull.ctx_instance:
            self._fail(pull, "RequestNotFound", f"context executor at {leg.endpoint} restarted (instance "
                       f"{peer.welcome.ctx_instance}, request issued by {pull.ctx_instance})")
            return True
        leg.remote, leg.agent_kind, leg.peer_name = peer.remote, peer.agent_kind, peer.peer_name
        staged = not pull.withdraw and self._staging.want_staged(pull, leg, peer)
        ahead = pull.ctx_blocks is not None and not staged
        leg.advance(LegState.FETCH_SENT)
        done = False
        try:
            if ahead:  # the ids are known: the leg is fetched now, its reads go out before the Fetch
                leg.read_ahead_from(pull.ctx_blocks, peer.remote.layout)
                pull.mark("fetched")
                pull.post_ready_layers(leg, self.pool.rank_pool, self.pool.agents[leg.agent_kind])
                done = self._piggyback_done(leg)
        finally:  # a post that failed still sends the Fetch: the failure's Done(ok=False) then releases the reader
            self._peers.send(peer, m.Fetch(pull.ctx_request_id, self.pool.rank, self.config.stream_layers, staged,
                                           pull.from_token, pull.secret, ahead,
                                           pull.ctx_blocks if ahead else (), done).encode())
            if done:
                leg.advance(LegState.DONE_SENT)
        if not peer.legs:  # an idle peer: its silence is measured from this request on
            peer.last_heard = now
        peer.legs.add((pull.request_id, leg.ctx_rank))  # watched for silence from now on
        return False

    def _piggyback_done(self, leg: Leg) -> bool:
        """Whether a read-ahead leg's Fetch may carry its Done: every read of the leg was posted and has
        already finished (a small read on a fast path settles as it is posted), there is nothing to hash
        (verification mode sends digests with Done), and no test hook wants to run between reads and Done.
        The context rank then answers the one frame with DoneAck: one message and one wake-up fewer."""
        return (leg.all_posted and not self.config.verify and not self._hooked()
                and all(h.state() is XferState.DONE for h in leg.handles))
