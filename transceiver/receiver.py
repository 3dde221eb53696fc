"""Generation-side receiver: asks context ranks for a request's KV blocks and pulls them.

Owns the per-request pull state machine (pull.py) and one DEALER socket per context rank; one I/O thread
owns both, the engine talks to it through a command queue. Never frees or reuses local blocks itself: it
reports a terminal ReceiveResult and the executor frees or keeps the blocks. Every wait is bounded by the
request's deadline, the handshake timeout or the peer-silence timeout.

A pull succeeds only when every context rank it read from acknowledged Done with valid=True, i.e. confirmed
its blocks were still pinned when the reads finished.
"""

from __future__ import annotations

import logging
import time
import uuid

import numpy as np
import zmq

from ..errors import (KvBridgeError, LayoutMismatchError, LeaseExpired, ProtocolError, RequestCancelled,
                      RequestNotFound, TransceiverError)
from ..formatter.mapping import MAPPING_VERSION, mapping_for
from . import messages as m
from . import metrics
from .config import TransceiverConfig, local_host_id
from .handshake import accept_welcome
from .params import DisaggParams
from .pool import LocalPool
from .ctx_peer import CtxPeer, PeerState
from .pull import Leg, Pull, PullState, ReceiveResult
from .iothread import IOThread
from .receiver_work import ReceiverWork
from .sockets import make_dealer

log = logging.getLogger(__name__)

__all__ = ["Receiver", "ReceiveResult"]

_ERROR_TYPES = {
    m.ErrorCode.UNKNOWN_REQUEST.value: RequestNotFound, m.ErrorCode.LEASE_EXPIRED.value: LeaseExpired,
    m.ErrorCode.LAYOUT_MISMATCH.value: LayoutMismatchError, m.ErrorCode.VERSION.value: ProtocolError,
    m.ErrorCode.MALFORMED.value: ProtocolError, m.ErrorCode.CANCELLED.value: RequestCancelled,
}


class Receiver(IOThread, ReceiverWork):
    """Pulls KV into this generation rank's pool.

    Args:
        pool: this rank's registered pool.
        config: timeouts and agent preferences.
        instance: this generation executor's id (same on all its ranks).
    """

    _what = "receiver"

    def __init__(self, pool: LocalPool, config: TransceiverConfig, instance: str | None = None) -> None:
        self.pool, self.config, self.layout = pool, config, pool.layout
        self.instance = instance or uuid.uuid4().hex
        self._peers: dict[str, CtxPeer] = {}
        self._pulls: dict[int, Pull] = {}
        self._host = local_host_id()
        self._last_beat = 0.0
        self.before_confirm = None  # fault injection for tests: called with the Pull once its reads are done
        if config.verify:
            from ..formatter import digest  # noqa: F401 - import torch/xxhash now, not mid-transfer
        self._start_io(zmq.Context(), f"kvb-receiver-r{pool.rank}")

    # --- engine-facing API ----------------------------------------------------------------------------
    def submit(self, request_id: int, params: DisaggParams, block_ids, num_tokens: int,
               timeout_s: float | None = None, from_token: int = 0) -> None:
        """Start pulling `params`' request into local `block_ids` (the first num_tokens tokens).

        from_token > 0 (prefix reuse): the local blocks already hold tokens [0, from_token); only the rest
        is read (the staged path packs only the rest too).
        """
        if not 0 <= int(from_token) < int(num_tokens):
            raise TransceiverError(f"request {request_id}: from_token {from_token} outside its {num_tokens} "
                                   f"tokens")
        blocks = np.asarray(block_ids, dtype=np.int64).copy()
        self._command("submit", int(request_id), params, blocks, int(num_tokens),
                      float(timeout_s or self.config.transfer_timeout_s), int(from_token))

    def cancel(self, request_id: int) -> None:
        """Abort a pull; it still reports a (failed) result once its reads have settled."""
        self._command("cancel", int(request_id))

    def poll_finished(self) -> list[ReceiveResult]:
        """Pulls finished since the last call (never blocks)."""
        return super().poll_finished()

    @property
    def in_flight(self) -> int:
        return len(self._pulls)

    def close(self, timeout: float = 5.0) -> None:
        if self._stop_io(timeout):
            for p in self._peers.values():
                if p.sock is not None:
                    p.sock.close(0)
            self._zctx.term()

    # --- I/O thread -----------------------------------------------------------------------------------
    def _loop_once(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_rx, zmq.POLLIN)
        socks = {p.sock: p for p in self._peers.values() if p.sock is not None}
        for s in socks:
            poller.register(s, zmq.POLLIN)
        # While reads are in flight, completion is noticed by polling the handles: spin (a zero-timeout poll,
        # yielding the GIL) so a finished read is seen within microseconds; otherwise sleep in the poll.
        busy = any(p.state in (PullState.READ, PullState.DRAIN) for p in self._pulls.values())
        ready = dict(poller.poll(0 if busy else 20))
        if busy and not ready:
            time.sleep(0)
        self._drain_commands()
        for s, peer in socks.items():
            if s in ready:
                for _ in range(256):
                    try:
                        frame = s.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    peer.last_heard = time.monotonic()
                    self._on_frame(peer, frame)
        self._advance(time.monotonic())

    def _do_command(self, cmd) -> None:
        if cmd[0] == "submit":
            _, rid, params, blocks, n, timeout, from_token = cmd
            now = time.monotonic()
            try:
                mapping = mapping_for(params.ctx_layout, self.layout)
            except LayoutMismatchError as e:
                self._report_now(rid, "LayoutMismatchError", str(e))
                return
            if rid in self._pulls:
                self._report_now(rid, "TransceiverError", f"request {rid} is already being pulled")
                return
            legs = {p.ctx_rank: Leg(p.ctx_rank, params.endpoints[p.ctx_rank], p)
                    for p in mapping.pieces(self.pool.rank)}
            self._pulls[rid] = Pull(rid, params.ctx_request_id, params.ctx_instance, blocks, n, now + timeout,
                                    legs, from_token=from_token, secret=params.secret)
            for leg in legs.values():
                self._ensure_session(leg.endpoint, now)
        elif cmd[0] == "cancel":
            p = self._pulls.get(cmd[1])
            if p is not None:
                p.fail("RequestCancelled", f"request {p.request_id} was cancelled on the generation side",
                       self.config.drain_timeout_s)

    def _report_now(self, rid: int, etype: str, error: str) -> None:
        result = ReceiveResult(rid, False, error, etype)
        metrics.on_received(result)
        self._finished.append(result)

    # --- sessions -------------------------------------------------------------------------------------
    def _ensure_session(self, endpoint: str, now: float) -> CtxPeer:
        peer = self._peers.get(endpoint)
        if peer is None:
            peer = self._peers[endpoint] = CtxPeer(endpoint)
        # (Re)send hello when new, when a failure is older than a second, or when a hello went unanswered for a
        # second (hello is idempotent on the context side).
        if peer.state is PeerState.NEW or (peer.state in (PeerState.FAILED, PeerState.HELLO) and now - peer.hello_at > 1.0):
            if peer.sock is None:
                ident = f"{self.instance}:{self.pool.rank}:{uuid.uuid4().hex[:6]}".encode()
                peer.sock = make_dealer(self._zctx, self.config, endpoint, ident)
            hello = m.Hello(self.instance, self.pool.rank, self.layout.to_wire(), list(self.pool.agents), self._host,
                            MAPPING_VERSION)
            self._send(peer, hello.encode())
            if peer.state is not PeerState.HELLO:
                peer.first_hello = now
            peer.state, peer.hello_at, peer.last_heard = PeerState.HELLO, now, now
        return peer

    def _reset(self, peer: CtxPeer) -> None:
        """Drop a peer's socket and session (queued stale frames go with it); the next use re-handshakes."""
        if peer.sock is not None:
            peer.sock.close(0)
        peer.sock, peer.state, peer.welcome, peer.remote = None, PeerState.NEW, None, None
        # The agent keeps knowing the peer: reads to it may still be in flight (forgetting it would turn
        # their status into an error while data can still land); a new Welcome re-connects it.
        peer.peer_name = peer.agent_kind = ""

    def _send(self, peer: CtxPeer, frame: bytes) -> None:
        if peer.sock is None:  # reset after silence or an error; its context rank's lease covers the rest
            return
        try:
            peer.sock.send(frame, zmq.NOBLOCK)
        except zmq.ZMQError as e:  # queue full: the deadline covers retries
            log.debug("send to %s failed: %s", peer.endpoint, e)

    def _on_welcome(self, peer: CtxPeer, w: m.Welcome) -> None:
        try:
            remote, kind, name = accept_welcome(self.pool, w, peer.endpoint)
        except KvBridgeError as e:
            peer.state, peer.error = PeerState.FAILED, (type(e).__name__, f"context rank at {peer.endpoint}: {e}")
            return
        peer.state, peer.welcome, peer.remote, peer.agent_kind, peer.peer_name = PeerState.READY, w, remote, kind, name

    # --- frames from context ranks -------------------------------------------------------------------
    def _on_frame(self, peer: CtxPeer, frame: bytes) -> None:
        try:
            msg = m.decode(frame)
        except ProtocolError as e:
            log.warning("bad frame from %s: %s", peer.endpoint, e)
            return
        if isinstance(msg, m.Welcome):
            self._on_welcome(peer, msg)
            return
        if isinstance(msg, m.Error) and msg.ctx_request_id < 0:
            if msg.code == m.ErrorCode.NO_SESSION.value:
                self._reset(peer)
                return
            etype = _ERROR_TYPES.get(msg.code, TransceiverError).__name__
            peer.state, peer.error = PeerState.FAILED, (etype, f"context rank at {peer.endpoint}: {msg.message}")
            return
        if isinstance(msg, m.HeartbeatAck):
            for rid, alive in zip(msg.ctx_request_ids, msg.alive):
                if alive is False:
                    self._fail_ctx(peer, rid, "LeaseExpired", f"context rank at {peer.endpoint} no longer pins "
                                   f"request {rid} (lease lost)")
            return
        rid = getattr(msg, "ctx_request_id", -1)
        for pull in self._pulls.values():
            leg = next((lg for lg in pull.legs.values() if lg.endpoint == peer.endpoint), None)
            if pull.ctx_request_id == rid and leg is not None:
                self._on_leg_message(pull, leg, peer, msg)

    def _fail_ctx(self, peer: CtxPeer, ctx_rid: int, etype: str, error: str) -> None:
        """A context rank says it no longer pins `ctx_rid` for us. After Done was sent that is expected (the
        DoneAck decides validity); before, the pull has lost its blocks."""
        for pull in self._pulls.values():
            if pull.ctx_request_id == ctx_rid and any(lg.endpoint == peer.endpoint and not lg.done_sent
                                                      for lg in pull.legs.values()):
                pull.fail(etype, error, self.config.drain_timeout_s)

    def _on_leg_message(self, pull: Pull, leg: Leg, peer: CtxPeer, msg: m.Message) -> None:
        if isinstance(msg, m.Blocks):
            if msg.num_tokens != pull.num_tokens:
                pull.fail("ProtocolError", f"context rank {leg.ctx_rank} holds {msg.num_tokens} tokens of request "
                          f"{pull.ctx_request_id}, the generation side expects {pull.num_tokens}",
                          self.config.drain_timeout_s)
            leg.fetched, leg.ctx_blocks, leg.layers_ready = True, msg.block_ids, msg.layers_ready
            if msg.staging_addr >= 0:
                w = peer.welcome
                if (leg.slot is None or msg.staging_bytes != leg.slot_bytes or msg.staging_addr < w.staging_base
                        or msg.staging_addr + msg.staging_bytes > w.staging_base + w.staging_bytes):
                    pull.fail("ProtocolError", f"context rank {leg.ctx_rank} staged {msg.staging_bytes} bytes at "
                              f"{msg.staging_addr:#x}, outside its arena or not the piece's size", self.config.drain_timeout_s)
                    return
                leg.remote_slot = msg.staging_addr
            elif leg.slot is not None:  # the context rank went direct (its arena was full): give the slot back
                self.pool.arena.free(leg.slot)
                leg.slot, leg.slot_bytes = None, 0
        elif isinstance(msg, m.LayersReady):
            leg.layers_ready = max(leg.layers_ready, msg.layers_ready)
        elif isinstance(msg, m.DoneAck):
            leg.acked = True
            peer.legs.discard((pull.request_id, leg.ctx_rank))
            if not msg.valid:
                pull.fail("LeaseExpired", f"context rank {leg.ctx_rank} released request {pull.ctx_request_id} "
                          f"before the read was confirmed ({msg.reason})", self.config.drain_timeout_s)
            elif not msg.intact:
                pull.fail("IntegrityError", f"context rank {leg.ctx_rank}, request {pull.ctx_request_id}: "
                          f"{msg.reason}", self.config.drain_timeout_s)
        elif isinstance(msg, m.Error):
            if msg.code == m.ErrorCode.NO_SESSION.value and not leg.retried_session:
                leg.retried_session, leg.fetch_sent = True, False
                self._reset(peer)
                return
            etype = _ERROR_TYPES.get(msg.code, TransceiverError).__name__
            peer.legs.discard((pull.request_id, leg.ctx_rank))
            pull.fail(etype, f"context rank {leg.ctx_rank} ({leg.endpoint}): {msg.message}", self.config.drain_timeout_s)

    # --- progress -------------------------------------------------------------------------------------
    def _advance(self, now: float) -> None:
        for pull in list(self._pulls.values()):
            try:
                self._advance_pull(pull, now)
            except KvBridgeError as e:
                pull.fail(type(e).__name__, str(e), self.config.drain_timeout_s)
        self._watch_peers(now)
        if now - self._last_beat >= self.config.heartbeat_s:
            self._last_beat = now
            self._heartbeat(now)

    def _advance_pull(self, pull: Pull, now: float) -> None:
        """Move one pull as far as it can go this tick: each state's step runs when the pull is in that state
        (a step may move it on, so one tick can take it from handshake to done); a step that returns True
        ends the tick for this pull (it failed, or waits)."""
        if pull.state not in (PullState.DRAIN, PullState.DONE) and now > pull.deadline:
            pull.fail("DeadlineExceeded", f"request {pull.request_id} (context request {pull.ctx_request_id}) not "
                      f"received within its deadline (stage: {pull.state})", self.config.drain_timeout_s)
        for state, step in ((PullState.HANDSHAKE, self._step_handshake), (PullState.READ, self._step_read),
                            (PullState.CONFIRM, self._step_confirm), (PullState.DRAIN, self._step_drain)):
            if pull.state == state and step(pull, now):
                return

    def _step_handshake(self, pull: Pull, now: float) -> bool:
        """Sessions up, a Fetch to every context rank, reads posted as each rank's block ids arrive."""
        for leg in pull.legs.values():
            peer = self._ensure_session(leg.endpoint, now)
            if peer.state is PeerState.FAILED:
                pull.fail(*peer.error, self.config.drain_timeout_s)
                return True
            if peer.state is PeerState.HELLO and now - peer.first_hello > self.config.handshake_timeout_s:
                pull.fail("PeerGone", f"context rank at {leg.endpoint} did not answer hello within "
                          f"{self.config.handshake_timeout_s:g} s", self.config.drain_timeout_s)
                return True
            if peer.state is PeerState.READY and not leg.fetch_sent and self._send_fetch(pull, leg, peer, now):
                return True
            if leg.fetched and not leg.handles:  # start this leg's reads now; others may still be fetching
                pull.mark("fetched")
                pull.post_ready_layers(leg, self.pool.rank_pool, self.pool.agents[leg.agent_kind])
        if all(leg.fetched for leg in pull.legs.values()):
            pull.state = PullState.READ
        return False

    def _send_fetch(self, pull: Pull, leg: Leg, peer: CtxPeer, now: float) -> bool:
        """Ask `peer` for this leg's block ids; True (the pull failed) when the context executor restarted."""
        if peer.welcome.ctx_instance != pull.ctx_instance:
            pull.fail("RequestNotFound", f"context executor at {leg.endpoint} restarted (instance "
                      f"{peer.welcome.ctx_instance}, request issued by {pull.ctx_instance})",
                      self.config.drain_timeout_s)
            return True
        leg.remote, leg.agent_kind, leg.peer_name = peer.remote, peer.agent_kind, peer.peer_name
        staged = self._want_staged(pull, leg, peer)
        self._send(peer, m.Fetch(pull.ctx_request_id, self.pool.rank, self.config.stream_layers,
                                 staged, pull.from_token, pull.secret).encode())
        leg.fetch_sent = True
        if not peer.legs:  # an idle peer: its silence is measured from this request on
            peer.last_heard = now
        peer.legs.add((pull.request_id, leg.ctx_rank))  # watched for silence from now on
        return False

    def _step_read(self, pull: Pull, now: float) -> bool:
        """Post what became readable; once every read settled, unpack/hash off the I/O thread if needed."""
        for leg in pull.legs.values():
            if not leg.all_posted:
                pull.post_ready_layers(leg, self.pool.rank_pool, self.pool.agents[leg.agent_kind])
            err = leg.failed()
            if err:
                pull.fail("TransferFailed", f"read from context rank {leg.ctx_rank} failed: {err}",
                          self.config.drain_timeout_s)
                return True
        if all(leg.all_posted and not leg.pending() for leg in pull.legs.values()):
            pull.mark("read_done")
            if self.before_confirm is not None:
                self.before_confirm(pull)
            if self.config.verify or any(leg.remote_slot >= 0 for leg in pull.legs.values()):
                # unpack staged legs and hash off the I/O thread, so heartbeats keep the leases alive
                pull.verifying = self._worker.submit(self._finish_pull, pull)
            pull.state = PullState.CONFIRM
        return False

    def _step_confirm(self, pull: Pull, now: float) -> bool:
        """Done to every context rank (with digests in verify mode); the pull is done once all acked."""
        if not any(leg.done_sent for leg in pull.legs.values()):
            if pull.verifying is not None and not pull.verifying.done():
                return True
            try:
                digests = pull.verifying.result() if pull.verifying is not None else {}
            except Exception as ex:  # noqa: BLE001 - an unpack or hash that failed fails the pull, not the loop
                pull.fail("TransferFailed", f"unpacking or hashing the received KV failed: {ex}",
                          self.config.drain_timeout_s)
                return True
            for r, leg in pull.legs.items():
                self._send(self._peers[leg.endpoint],
                           m.Done(pull.ctx_request_id, self.pool.rank, True, "", digests.get(r, [])).encode())
                leg.done_sent = True
        if all(leg.acked for leg in pull.legs.values()):
            pull.state = PullState.DONE
            self._complete(pull)
        return False

    def _step_drain(self, pull: Pull, now: float) -> bool:
        """A failed pull is reported only once no read can still write into its blocks: the executor frees
        them on the report. Reads that outlive the drain deadline (a transport that cannot abort data in
        flight) keep the pull quarantined, blocks held, until they settle or quarantine_s runs out."""
        settled = not any(leg.pending() for leg in pull.legs.values())
        if settled or now > pull.drain_deadline:
            for leg in pull.legs.values():  # the context ranks may release their side now
                if leg.fetched and not leg.done_sent and leg.endpoint in self._peers:
                    self._send(self._peers[leg.endpoint],
                               m.Done(pull.ctx_request_id, self.pool.rank, False, pull.error[:500]).encode())
                    leg.done_sent = True
        if not settled and now > pull.drain_deadline and not pull.quarantined:
            pull.quarantined = True
            log.error("request %d: reads still in flight %.1f s after the failure; its blocks stay held until "
                      "they settle", pull.request_id, self.config.drain_timeout_s)
        if settled or now > pull.drain_deadline + self.config.quarantine_s:
            if not settled:
                log.critical("request %d: reads never settled; releasing its blocks after %.0f s of quarantine",
                             pull.request_id, self.config.quarantine_s)
            pull.state = PullState.DONE
            self._complete(pull)
        return False

    def _complete(self, pull: Pull) -> None:
        self._pulls.pop(pull.request_id, None)
        if pull.verifying is not None:
            try:  # an unpack must not outlive its slot
                pull.verifying.exception(timeout=self.config.drain_timeout_s)
            except Exception:  # noqa: BLE001 - timed out: the slot stays allocated (leaked, not reused)
                log.error("request %d: unpack still running after %.1f s; keeping its slot", pull.request_id,
                          self.config.drain_timeout_s)
                for leg in pull.legs.values():
                    leg.slot = None
        for leg in pull.legs.values():
            for h in leg.handles:
                h.release()
            if leg.slot is not None:
                self.pool.arena.free(leg.slot)
                leg.slot = None
            peer = self._peers.get(leg.endpoint)
            if peer is not None:
                peer.legs.discard((pull.request_id, leg.ctx_rank))
        agents = tuple(sorted({leg.agent_kind for leg in pull.legs.values() if leg.agent_kind}))
        result = pull.result(agents)
        metrics.on_received(result)
        self._finished.append(result)

    def _watch_peers(self, now: float) -> None:
        for peer in self._peers.values():
            if peer.legs and now - peer.last_heard > self.config.peer_timeout_s:
                err = f"context rank at {peer.endpoint} silent for {now - peer.last_heard:.1f} s"
                for rid, _ in list(peer.legs):
                    p = self._pulls.get(rid)
                    if p is not None:
                        p.fail("PeerGone", err, self.config.drain_timeout_s)
                peer.legs.clear()
                self._reset(peer)

    def _heartbeat(self, now: float) -> None:
        for peer in self._peers.values():
            if peer.sock is None:
                continue
            ids = sorted({self._pulls[r].ctx_request_id for r, _ in peer.legs if r in self._pulls})
            if not ids and peer.state is PeerState.READY and now - peer.last_heard > 2 * self.config.peer_timeout_s:
                self._reset(peer)  # an idle peer that stopped answering: drop its socket, re-handshake on use
                continue
            if ids or (peer.state is PeerState.READY and now - peer.last_sent >= self.config.peer_timeout_s / 3):
                peer.last_sent = now  # an empty heartbeat keeps an idle session alive on the context rank
                self._send(peer, m.Heartbeat(ids).encode())
