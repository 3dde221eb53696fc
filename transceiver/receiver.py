"""Generation-side receiver: asks context ranks for a request's KV blocks and pulls them.

Owns the per-request pulls (pull.py: the Pull and Leg state machines) and one DEALER socket per context rank
(ctx_peer.py: the peer state machine); one I/O thread owns both, the engine talks to it through a command
queue of typed commands. Each tick moves every pull through `_steps`, a table state -> step method; frames are
dispatched by message type through tables. The work off the I/O thread (unpack, hash) and the staged-path
decision are collaborators (receiver_work.py). Never frees or reuses local blocks itself: it reports a
terminal ReceiveResult and the executor frees or keeps the blocks. Every wait is bounded by the request's
deadline, the handshake timeout or the peer-silence timeout.

A pull succeeds only when every context rank it read from acknowledged Done with valid=True, i.e. confirmed
its blocks were still pinned when the reads finished.
"""

from __future__ import annotations

import logging
import os
import time
import uuid

import numpy as np
import zmq

from ..errors import KvBridgeError, LayoutMismatchError, ProtocolError, TransceiverError
from ..formatter.mapping import MAPPING_VERSION, mapping_for
from ..formatter.scratch import PlanScratch
from . import messages as m
from . import metrics
from .commands import CancelPull, Submit, Touch
from .config import TransceiverConfig, local_host_id
from .ctx_peer import CtxPeer
from .peers import CtxPeers
from .handshake import accept_welcome
from .iothread import IOThread
from .outbox import each_part
from .params import DisaggParams
from .pool import LocalPool
from .pull import Leg, LegState, Pull, PullState, ReceiveResult
from .receiver_handshake import Handshake
from .receiver_legs import LegFrames
from .receiver_work import PullFinisher, StagingPolicy

log = logging.getLogger(__name__)

__all__ = ["Receiver", "ReceiveResult"]

_POLLED = frozenset({PullState.READ, PullState.DRAIN})  # states whose step polls transfer handles every tick
_SWEEP_S = 0.005  # every pull is stepped at least this often
_READ_POLL_S = 50e-6  # pause between looks at reads in flight (a spin costs the peer its core: RESULTS.md)
_INLINE_MAX = 4  # a submit runs the turn itself only while fewer pulls are in flight (`_inline`)


class Receiver(IOThread):
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
        self._pulls: dict[int, Pull] = {}
        self._by_ctx: dict[int, set[int]] = {}  # context request id -> our pulls of it (frames name the former)
        self._withdrawals = 0  # the last withdrawal's id (they count down from -1)
        self._touched: set[int] = set()  # pulls an event reached this tick: advanced now (the rest every _SWEEP_S)
        self._sweep_at = 0.0  # when every pull is advanced next (deadlines, handshakes, silence)
        self._last_beat = 0.0
        self.before_confirm = None  # fault injection for tests: called with the Pull once its reads are done
        self._plans = PlanScratch()  # plan arrays reused once their reads settled (whoever holds the turn lock)
        self._finisher = PullFinisher(pool, config.verify)
        self._staging = StagingPolicy(pool, config)
        self._commands = {Submit: self._on_submit, CancelPull: self._on_cancel,
                          Touch: lambda c: self._touched.add(c.request_id)}
        self._peer_messages = {m.Welcome: self._on_welcome, m.Error: self._on_error,
                               m.HeartbeatAck: self._on_heartbeat_ack}
        self._steps = {PullState.HANDSHAKE: None, PullState.READ: self._step_read,
                       PullState.CONFIRM: self._step_confirm, PullState.DRAIN: self._step_drain}
        if config.verify:
            from ..formatter import digest  # noqa: F401 - import torch/xxhash now, not mid-transfer
        hello = m.Hello(self.instance, pool.rank, self.layout.to_wire(), list(pool.agents), local_host_id(),
                        MAPPING_VERSION).encode()
        zctx = zmq.Context()
        self._peers = CtxPeers(zctx, config, hello, f"{self.instance}:{pool.rank}")
        self._leg_messages = LegFrames(pool.arena, self._fail, self._peers.reset).handlers
        self._steps[PullState.HANDSHAKE] = Handshake(pool, config, self._peers, self._staging, self._fail,
                                                     lambda: self.before_confirm is not None).step
        self._start_io(zctx, f"kvb-receiver-r{pool.rank}")

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
        cmd = Submit(int(request_id), params, blocks, int(num_tokens),
                     float(timeout_s or self.config.transfer_timeout_s), int(from_token))
        if self.before_confirm is not None or len(self._pulls) >= _INLINE_MAX:  # the hook runs on the I/O
            self._command(cmd)  # thread only; under load the loop's turn takes many submits at once, one send
            return
        self._command(cmd, wake=False)
        self._inline()

    def withdraw(self, params: DisaggParams, num_tokens: int, timeout_s: float | None = None) -> None:
        """Tell the context ranks this rank would have read `params`' request from that it never will (its
        decode was aborted before its pull began): a Fetch (the secret proves the right to), then Done(ok=False),
        so they free the request now, or as it is published, not after its pickup timeout. Reports nothing."""
        self._withdrawals -= 1  # negative ids: never an owner's request id
        self._command(Submit(self._withdrawals, params, np.zeros(0, np.int64), max(1, int(num_tokens)),
                             float(timeout_s or self.config.transfer_timeout_s), 0, withdraw=True))

    def cancel(self, request_id: int) -> None:
        """Abort a pull; it still reports a (failed) result once its reads have settled."""
        self._command(CancelPull(int(request_id)))

    def poll_finished(self) -> list[ReceiveResult]:
        """Pulls finished since the last call (never blocks)."""
        return super().poll_finished()

    @property
    def in_flight(self) -> int:
        return len(self._pulls)

    def close(self, timeout: float = 5.0) -> None:
        if self._stop_io(timeout):
            self._peers.close()
            self._zctx.term()

    # --- I/O thread -----------------------------------------------------------------------------------
    def _loop_once(self) -> None:
        with self._turn_lock:
            self._stale = False
            self._drain_commands()
            for peer in self._peers.readable():
                sock = peer.sock
                for parts in self._received(sock):
                    peer.last_heard = time.monotonic()
                    self._on_parts(peer, sock, parts)
                    if peer.sock is not sock:  # reset by this frame ("no session"): the socket is closed
                        break
            now = time.monotonic()
            self._advance(now)
            self._peers.flush()  # what this turn sent: one message per context rank
            if self._peers.input_waiting():  # (a send may take the descriptor's word of a frame that came)
                return
            # While reads are in flight, completion is noticed by polling the handles: a zero-timeout poll, then a
            # short sleep (_READ_POLL_S) when nothing came (no pause while a read may end any moment:
            # pull.near_end, cuda_ipc's); otherwise sleep in the poll.
            busy = any(p.state in _POLLED for p in self._pulls.values())
            poller = self._peers.poller(self._wake_rx)
        ready = self._wait(poller, 0 if busy else 20)
        if busy and not ready:
            now = time.monotonic()
            with self._turn_lock:
                near = any(p.state in _POLLED and p.near_end(now) for p in self._pulls.values())
            if near:
                os.sched_yield()
            else:
                time.sleep(_READ_POLL_S)

    def _inline(self) -> None:
        """A caller's turn (`submit`): when the loop sleeps, the queued commands run on the calling thread and
        the pulls they touched step as far as they can, so a new pull's Fetch (with its reads, read-ahead) leaves
        now instead of after the I/O thread wakes; what is left (reads to poll, frames, new sockets) goes back
        to the loop. When the loop is busy the command simply waits for its next turn."""
        if not self._try_inline():
            return
        more = True
        try:
            self._drain_commands()
            now = time.monotonic()
            due = [self._pulls[r] for r in self._touched if r in self._pulls]
            self._touched.clear()
            self._step(due, now)
            self._peers.flush()
            more = bool(self._touched) or self._peers.changed or self._peers.input_waiting() or any(
                p.state in _POLLED for p in due)
        except Exception:  # noqa: BLE001 - the loop's own turn takes it from here
            log.exception("receiver: a caller's turn failed (the I/O thread goes on)")
        finally:
            self._end_inline(more)

    def _touch_later(self, rid: int) -> None:
        """Any thread: have the I/O thread step pull `rid` at once (not at the next sweep)."""
        try:
            self._command(Touch(rid))
        except KvBridgeError:  # closing: nothing left to step
            pass

    def _do_command(self, cmd: Submit | CancelPull | Touch) -> None:
        self._commands[type(cmd)](cmd)

    def _on_submit(self, c: Submit) -> None:
        now = time.monotonic()
        try:
            mapping = mapping_for(c.params.ctx_layout, self.layout)
        except LayoutMismatchError as e:
            self._report_now(c.request_id, "LayoutMismatchError", str(e))
            return
        if c.request_id in self._pulls:
            self._report_now(c.request_id, "TransceiverError", f"request {c.request_id} is already being pulled")
            return
        legs = {p.ctx_rank: Leg(p.ctx_rank, c.params.endpoints[p.ctx_rank], p) for p in mapping.pieces(self.pool.rank)}
        ahead = c.params.ctx_block_ids if self.config.read_ahead and not c.withdraw else None
        self._pulls[c.request_id] = Pull(c.request_id, c.params.ctx_request_id, c.params.ctx_instance, c.blocks,
                                         c.num_tokens, now + c.timeout_s, legs, from_token=c.from_token,
                                         secret=c.params.secret, scratch=self._plans, withdraw=c.withdraw,
                                         ctx_blocks=None if ahead is None else np.asarray(ahead, dtype=np.int64))
        self._by_ctx.setdefault(c.params.ctx_request_id, set()).add(c.request_id)
        self._touched.add(c.request_id)
        for leg in legs.values():
            self._peers.ensure(leg.endpoint, now)

    def _on_cancel(self, c: CancelPull) -> None:
        p = self._pulls.get(c.request_id)
        if p is not None:
            self._fail(p, "RequestCancelled", f"request {p.request_id} was cancelled on the generation side")

    def _fail(self, pull: Pull, error_type: str, error: str) -> None:
        pull.fail(error_type, error, self.config.drain_timeout_s)
        self._touched.add(pull.request_id)

    def _report_now(self, rid: int, etype: str, error: str) -> None:
        result = ReceiveResult(rid, False, error, etype)
        metrics.on_received(result)
        self._report(result)

    # --- frames from context ranks: for the peer, or for the legs of its pulls ---------------------------
    def _on_parts(self, peer: CtxPeer, sock: zmq.Socket, parts: list[bytes]) -> None:
        """One ZeroMQ message from a context rank: up to MAX_BATCH wire messages, each handled alone."""
        def handle(frame: bytes) -> None:
            if peer.sock is not sock:  # reset by the frame before: the rest was for the closed session
                raise StopIteration
            self._on_frame(peer, frame)

        refused = each_part(parts, handle, f"context rank at {peer.endpoint}")
        if refused:
            log.warning("context rank at %s: %s; ignored", peer.endpoint, refused)

    def _on_frame(self, peer: CtxPeer, frame: bytes) -> None:
        try:
            msg = m.decode(frame)
        except ProtocolError as e:
            log.warning("bad frame from %s: %s", peer.endpoint, e)
            return
        handler = self._peer_messages.get(type(msg))
        if handler is not None:
            handler(peer, msg)
        else:
            self._to_legs(peer, msg)

    def _to_legs(self, peer: CtxPeer, msg: m.Message) -> None:
        handler = self._leg_messages.get(type(msg))
        if handler is None:
            log.warning("context rank at %s sent a %r message, which a generation rank does not accept",
                        peer.endpoint, msg.TYPE)
            return
        for rid in list(self._by_ctx.get(getattr(msg, "ctx_request_id", -1), ())):
            pull = self._pulls.get(rid)
            leg = None if pull is None else next((lg for lg in pull.legs.values() if lg.endpoint == peer.endpoint),
                                                 None)
            if leg is not None:
                self._touched.add(rid)
                handler(pull, leg, peer, msg)

    def _on_welcome(self, peer: CtxPeer, w: m.Welcome) -> None:
        self._sweep_at = 0.0  # pulls waiting for this session go on now
        try:
            remote, kind, name = accept_welcome(self.pool, w, peer.endpoint)
        except KvBridgeError as e:
            peer.refused(type(e).__name__, f"context rank at {peer.endpoint}: {e}")
            return
        peer.welcomed(w, remote, kind, name)

    def _on_error(self, peer: CtxPeer, msg: m.Error) -> None:
        if msg.ctx_request_id >= 0:  # about one request: its legs
            self._to_legs(peer, msg)
            return
        self._sweep_at = 0.0  # about the session: every pull through this peer reacts now
        if msg.code == m.ErrorCode.NO_SESSION.value:
            self._peers.reset(peer)
        else:
            etype = m.ERROR_TYPES.get(msg.code, TransceiverError).__name__
            peer.refused(etype, f"context rank at {peer.endpoint}: {msg.message}")

    def _on_heartbeat_ack(self, peer: CtxPeer, msg: m.HeartbeatAck) -> None:
        for rid, alive in zip(msg.ctx_request_ids, msg.alive):
            if alive is False:
                self._fail_ctx(peer, rid, "LeaseExpired", f"context rank at {peer.endpoint} no longer pins "
                               f"request {rid} (lease lost)")

    def _fail_ctx(self, peer: CtxPeer, ctx_rid: int, etype: str, error: str) -> None:
        """A context rank says it no longer pins `ctx_rid` for us. After Done was sent that is expected (the
        DoneAck decides validity); before, the pull has lost its blocks."""
        for pull in self._pulls.values():
            if pull.ctx_request_id == ctx_rid and any(lg.endpoint == peer.endpoint and not lg.done_sent
                                                      for lg in pull.legs.values()):
                self._fail(pull, etype, error)

    # --- progress: each pull's state has one step ------------------------------------------------------
    def _advance(self, now: float) -> None:
        """Step the pulls an event reached this tick and those polling their reads; every pull each _SWEEP_S
        (deadlines, handshakes, re-sent Hellos), or at once after a session-wide event."""
        if now >= self._sweep_at:
            self._sweep_at = now + _SWEEP_S
            due = list(self._pulls.values())
        else:
            due = [p for p in self._pulls.values() if p.state in _POLLED or p.request_id in self._touched]
        self._touched.clear()
        self._step(due, now)
        self._peers.watch(now, self._peer_gone)
        if now - self._last_beat >= self.config.heartbeat_s:
            self._last_beat = now
            self._peers.heartbeat(now, self._renewed)

    def _step(self, due: list[Pull], now: float) -> None:
        for pull in due:
            try:
                self._advance_pull(pull, now)
            except KvBridgeError as e:
                self._fail(pull, type(e).__name__, str(e))

    def _advance_pull(self, pull: Pull, now: float) -> None:
        """Move one pull as far as it can go this tick: the step of its state runs, and as long as a step
        moves it on, the next state's step runs too (one tick can take it from handshake to done); a step
        that returns True ends the tick for this pull (it failed, or waits)."""
        if not pull.terminal and now > pull.deadline:
            self._fail(pull, "DeadlineExceeded", f"request {pull.request_id} (context request "
                       f"{pull.ctx_request_id}) not received within its deadline (stage: {pull.state})")
        while pull.state in self._steps:
            state = pull.state
            if self._steps[state](pull, now) or pull.state is state:
                return

    def _step_read(self, pull: Pull, now: float) -> bool:
        """Post what became readable; once every read settled, unpack/hash off the I/O thread if needed."""
        for leg in pull.legs.values():
            if not leg.all_posted:
                pull.post_ready_layers(leg, self.pool.rank_pool, self.pool.agents[leg.agent_kind])
            err = leg.failed()
            if err:
                self._fail(pull, "TransferFailed", f"read from context rank {leg.ctx_rank} failed: {err}")
                return True
        if pull.staged:
            self._finisher.unpack_ready(pull, self._worker)  # each staged range unpacked once it has landed
        if all(leg.all_posted and not leg.pending() for leg in pull.legs.values()):
            pull.reads_settled()
            if self.before_confirm is not None:
                self.before_confirm(pull)
            if self._finisher.needed(pull):
                # unpack staged legs and hash off the I/O thread, so heartbeats keep the leases alive
                pull.verifying = self._worker.submit(self._finisher.finish, pull)
                pull.verifying.add_done_callback(lambda _f, rid=pull.request_id: self._touch_later(rid))
            pull.advance(PullState.CONFIRM)
        return False

    def _step_confirm(self, pull: Pull, now: float) -> bool:
        """Done to every context rank (with digests in verify mode); the pull is done once all acked."""
        if not all(leg.done_sent for leg in pull.legs.values()):  # (a read-ahead Fetch may have carried one)
            if pull.verifying is not None and not pull.verifying.done():
                return True
            try:
                digests = pull.verifying.result() if pull.verifying is not None else {}
            except Exception as ex:  # noqa: BLE001 - an unpack or hash that failed fails the pull, not the loop
                self._fail(pull, "TransferFailed", f"unpacking or hashing the received KV failed: {ex}")
                return True
            for r, leg in pull.legs.items():
                if not leg.done_sent:
                    self._peers.send(self._peers.get(leg.endpoint),
                                     m.Done(pull.ctx_request_id, self.pool.rank, True, "", digests.get(r, [])).encode())
                    leg.advance(LegState.DONE_SENT)
        if all(leg.state is LegState.ACKED for leg in pull.legs.values()):
            pull.advance(PullState.DONE)
            self._complete(pull)
        return False

    def _step_drain(self, pull: Pull, now: float) -> bool:
        """A failed pull is reported only once no read can still write into its blocks: the executor frees
        them on the report. Reads that outlive the drain deadline (a transport that cannot abort data in
        flight) keep the pull quarantined, blocks held, until they settle or quarantine_s runs out."""
        settled = not any(leg.pending() for leg in pull.legs.values())
        if settled or now > pull.drain_deadline:
            # The context ranks may release their side now: a leg whose Fetch was answered (FETCHED), or sent and
            # not answered (FETCH_SENT: the context rank may keep it waiting for the publish; the Done withdraws
            # it, so the request fails there as it is published instead of once our lapsed lease runs out)
            for leg in pull.legs.values():
                if (leg.state is LegState.FETCHED or leg.state is LegState.FETCH_SENT and not leg.refused) and \
                        self._peers.get(leg.endpoint) is not None:
                    self._peers.send(self._peers.get(leg.endpoint),
                               m.Done(pull.ctx_request_id, self.pool.rank, False, pull.error[:500]).encode())
                    leg.advance(LegState.DONE_SENT)
        if not settled and now > pull.drain_deadline and not pull.quarantined:
            pull.quarantined = True
            log.error("request %d: reads still in flight %.1f s after the failure; its blocks stay held until "
                      "they settle", pull.request_id, self.config.drain_timeout_s)
        if settled or now > pull.drain_deadline + self.config.quarantine_s:
            if not settled:
                log.critical("request %d: reads never settled; releasing its blocks after %.0f s of quarantine",
                             pull.request_id, self.config.quarantine_s)
            pull.advance(PullState.DONE)
            self._complete(pull)
        return False

    def _complete(self, pull: Pull) -> None:
        self._pulls.pop(pull.request_id, None)
        mine = self._by_ctx.get(pull.ctx_request_id)
        if mine is not None:
            mine.discard(pull.request_id)
            if not mine:
                del self._by_ctx[pull.ctx_request_id]
        pull.release(self.pool.arena, self.config.drain_timeout_s)
        for leg in pull.legs.values():
            peer = self._peers.get(leg.endpoint)
            if peer is not None:
                peer.legs.discard((pull.request_id, leg.ctx_rank))
        if pull.withdraw:  # nobody waits for its result
            return
        agents = tuple(sorted({leg.agent_kind for leg in pull.legs.values() if leg.agent_kind}))
        result = pull.result(agents)
        self._report(result)  # the owner first, the metrics after
        metrics.on_received(result)
        self._staging.hint(result)

    def _peer_gone(self, leg: tuple[int, int], why: str) -> None:
        pull = self._pulls.get(leg[0])
        if pull is not None:
            self._fail(pull, "PeerGone", why)

    def _renewed(self, peer: CtxPeer) -> list[int]:
        """The context request ids a heartbeat to `peer` renews: those of our pulls with traffic in flight."""
        return sorted({self._pulls[r].ctx_request_id for r, _ in peer.legs if r in self._pulls})
