"""Context-side sender: publishes a request's pinned blocks and serves generation ranks that pull them.

Owns the per-request entries on this context rank (send_state.py: the Entry state machine, PUBLISHED ->
READING -> COMPLETE | FAILED | EXPIRED | CANCELLED, through CANCELLING while readers finish) and the ROUTER
socket; one I/O thread owns the socket and all state, the engine talks to it through a queue of typed
commands, frames are dispatched by message type through a table. Packing and hashing run off the I/O thread
in a collaborator (sender_work.py). Never frees blocks itself: when a request is finished here — every
expected reader confirmed, or its lease ran out, or it was cancelled and no read is in flight — it is
reported by `poll_finished()` and the executor frees the blocks (after all its ranks agree).

A request's expected readers are the generation ranks the mapping assigns to this rank, for the generation
layout announced in the first reader's Hello. One generation instance per request.

A Fetch must carry the request's secret (handles.py); a wrong or missing one takes exactly the unknown-id path
(waits as if unpublished, then "no request"): nothing pinned, no lease, nothing learnt, not even a finished
request's status. Sessions are bounded (sessions.py); with CurveZMQ only authorised peers get here (zap.py).
"""

from __future__ import annotations

import collections
import hmac
import logging
import threading
import time
import uuid

import numpy as np
import zmq

from ..agents.memory import int_extremes
from ..errors import KvBridgeError, LayoutMismatchError, ProtocolError
from ..formatter.mapping import mapping_for
from . import messages as m
from . import metrics
from .commands import CancelSend, Layers, Publish
from .config import TransceiverConfig, local_host_id
from .handles import new_secret
from .handshake import check_hello
from .iothread import IOThread
from .outbox import Outbox, each_part
from .read_watch import ReadWatch
from .pool import LocalPool
from .send_state import EarlyFetches, Entry, EntryState, SendResult, Tomb, renew_leases, unknown_answer
from .sender_work import SenderJobs
from .sessions import Session, SessionTable
from .sockets import make_router, stop_authenticator
from .zap import HandshakeWatch, RejectLog

log = logging.getLogger(__name__)

__all__ = ["Sender", "SendResult"]

_TOMBSTONES = 10000
_SWEEP_S = 0.005  # deadlines are checked this often (and whenever the loop wakes idle)


class Sender(IOThread):
    """Serves this context rank's KV blocks to generation ranks.

    Args:
        pool: this rank's registered pool.
        config: timeouts, endpoint, agents.
        instance: this context executor's id (same on all its ranks); a random one by default.
    """

    _what = "sender"

    def __init__(self, pool: LocalPool, config: TransceiverConfig, instance: str | None = None) -> None:
        self.pool, self.config = pool, config
        self.instance = instance or uuid.uuid4().hex
        self.layout = pool.layout
        self._local_layers = self.layout.local_layers(pool.rank)  # asked per publish and per fetch
        zctx = zmq.Context()
        try:
            self._router, self.endpoint = make_router(zctx, config)
        except BaseException:
            stop_authenticator(zctx)
            zctx.destroy(0)
            raise
        self._entries: dict[int, Entry] = {}
        self._tomb: collections.OrderedDict[int, Tomb] = collections.OrderedDict()
        self._sessions = SessionTable(config.max_sessions, config.peer_timeout_s)
        self._refused = RejectLog(f"context rank {pool.rank}")
        curve = bool(self._router.getsockopt(zmq.CURVE_SERVER))
        self._handshakes = HandshakeWatch(self._router, self._refused) if curve else None  # plain peers
        arena, agents = pool.arena, {k: a.metadata() for k, a in pool.agents.items()}
        self._welcome = m.Welcome(self.instance, pool.rank, self.layout.to_wire(), agents, pool.bases,
                                  pool.num_blocks, pool.kind.value, pool.device, config.lease_s, local_host_id(),
                                  arena.base if arena else 0, arena.nbytes if arena else 0,
                                  arena.kind.value if arena else "").encode()  # the same for all
        self._early = EarlyFetches(_TOMBSTONES)
        self._expire_at = 0.0
        if config.verify:
            from ..formatter import digest  # noqa: F401 - import torch/xxhash now, not mid-transfer
        self._npinned = 0  # entries held by the I/O thread
        self._queued = 0  # publishes not yet taken up by the I/O thread
        self._nfetched = 0  # fetches accepted (a generation rank was given a request's blocks): `fetches`
        self._count_lock = threading.Lock()
        self._commands = {Publish: self._on_publish, Layers: self._on_layers, CancelSend: self._on_cancel}
        self._handlers = {m.Hello: self._on_hello, m.Fetch: self._on_fetch, m.Heartbeat: self._on_heartbeat,
                          m.Done: self._on_done}
        self._open_io(zctx, f"kvb-sender-r{pool.rank}")
        self._jobs = SenderJobs(pool, config, self._worker, self._send, self._wake)  # packing, hashing: off the loop
        self._outbox = Outbox(self._send_parts)
        self._readers = ReadWatch(pool.agents.values(), config.lease_s)  # agents progress fast while read
        self._poller = zmq.Poller()
        for sock in (self._router, self._wake_rx) + ((self._handshakes.socket,) if self._handshakes else ()):
            self._poller.register(sock, zmq.POLLIN)
        self._thread.start()

    # --- engine-facing API (any thread) -------------------------------------------------------------
    def publish(self, ctx_request_id: int, block_ids, num_tokens: int, layers_ready: int | None = None,
                secret: bytes | None = None) -> bytes:
        """Pin a request's blocks for pulling. `layers_ready` < local layers for layer-wise streaming.

        Returns the secret every Fetch of the request must carry: `secret` (all ranks of an executor pass the
        same one, from their RequestKey), or a fresh random one. Only a request published complete under a
        fresh secret accepts read-ahead Fetches (DisaggParams.ctx_block_ids): whoever holds a secret made
        here learnt it after this call, so its reads cannot have started before the blocks were final.
        """
        minted = secret is None
        secret = new_secret() if minted else bytes(secret)
        if len(secret) < 16:
            raise KvBridgeError(f"request {ctx_request_id}: a request secret must be at least 16 bytes")
        local = self._local_layers
        blocks = np.asarray(block_ids, dtype=np.int64).copy()
        need = -(-int(num_tokens) // self.layout.shape.tokens_per_block)
        lo, hi = int_extremes(blocks) if blocks.size else (0, 0)
        if blocks.size < need or lo < 0 or hi >= self.pool.num_blocks:
            raise KvBridgeError(f"request {ctx_request_id}: {blocks.size} block ids (need {need}) within a pool "
                                f"of {self.pool.num_blocks}")
        with self._count_lock:
            self._queued += 1
        # Woken only for a Fetch already waiting: otherwise the loop takes the publish before the first frame
        # that could need it (and parks a Fetch of an unknown request only after one more look, _on_fetch).
        self._command(Publish(int(ctx_request_id), blocks, int(num_tokens),
                               local if layers_ready is None else int(layers_ready), secret, minted),
                      wake=bool(self._early))
        return secret

    @property
    def sessions(self) -> int:
        return len(self._sessions)  # generation-rank sessions held now (bounded by max_sessions)

    @property
    def pinned(self) -> int:
        """Requests whose blocks are pinned on this rank (published and not yet finished)."""
        with self._count_lock:
            return self._npinned + self._queued

    @property
    def fetches(self) -> int:
        """Fetches accepted since start (generation ranks reading, or about to read, a request's blocks)."""
        with self._count_lock:
            return self._nfetched

    def mark_layers_ready(self, ctx_request_id: int, layers_ready: int) -> None:
        """Layer-wise streaming: the first `layers_ready` local layers of the request are now final."""
        self._command(Layers(int(ctx_request_id), int(layers_ready)))

    def cancel(self, ctx_request_id: int) -> None:
        """Stop serving a request. Blocks stay pinned until readers in flight finish or their lease expires."""
        self._command(CancelSend(int(ctx_request_id)))

    def poll_finished(self) -> list[SendResult]:
        """Requests finished on this rank since the last call (their blocks are no longer needed here)."""
        return super().poll_finished()

    def close(self, timeout: float = 5.0) -> None:
        if self._stop_io(timeout):
            stop_authenticator(self._zctx)
            if self._handshakes:
                self._handshakes.close()
            self._router.close(0)
            self._zctx.term()

    # --- I/O thread -----------------------------------------------------------------------------------
    def _loop_once(self) -> None:
        ready = self._wait(self._poller, min(0.05, self.config.heartbeat_s / 4) * 1000)
        self._drain_commands()
        if self._router in ready:
            for frames in self._received(self._router):
                self._on_frames(frames)
        if self._handshakes and self._handshakes.socket in ready:
            self._handshakes.drain()
        if self._jobs.busy:
            self._jobs.run_callbacks()
        now = time.monotonic()
        if now >= self._expire_at:  # leases and pickups are seconds: a sweep per frame would cost O(requests)
            self._expire_at = now + _SWEEP_S
            self._expire(now)
        self._outbox.flush()  # what this turn answered: one message per generation rank

    def _do_command(self, cmd: Publish | Layers | CancelSend) -> None:
        self._commands[type(cmd)](cmd)

    def _on_publish(self, c: Publish) -> None:
        with self._count_lock:
            self._queued -= 1
        if c.rid in self._entries:
            log.warning("request %d published twice; keeping the first", c.rid)
            return
        self._tomb.pop(c.rid, None)
        complete = c.layers_ready >= self._local_layers
        self._entries[c.rid] = Entry(c.rid, c.blocks, c.num_tokens, c.layers_ready,
                                     time.monotonic() + self.config.pickup_timeout_s, c.secret,
                                     read_ahead_ok=c.minted and complete)
        self._set_pinned()
        for d, ident, msg in self._early.take(c.rid):
            if hmac.compare_digest(c.secret, msg.secret):
                gave_up = self._early.withdrawn(c.rid, ident)
                self._on_fetch(ident, msg)
                e, s = self._entries.get(c.rid), self._sessions.get(ident)
                if gave_up is not None and e is not None and s is not None and e.fetched.get(s.gen_rank) == ident:
                    self._reader_done(ident, e, s.gen_rank, False, gave_up, True, "", ack=False)  # fails now
            else:  # a wrong secret keeps waiting, to the same deadline, exactly as for an unknown id
                self._early.add(c.rid, d, ident, msg)

    def _on_layers(self, c: Layers) -> None:
        e = self._entries.get(c.rid)
        if e is not None and c.layers_ready > e.layers_ready:
            e.layers_ready = c.layers_ready
            frame = m.LayersReady(c.rid, e.layers_ready).encode()
            for ident in e.readers_waiting(staged=False):  # a staged reader hears of layers once they are packed
                self._send(ident, frame)
            self._jobs.pack_more(e)

    def _on_cancel(self, c: CancelSend) -> None:
        e = self._entries.get(c.rid)
        if e is None:
            return
        if not e.active_readers:
            self._finish(e, EntryState.CANCELLED, "cancelled by the context executor")
            return
        # Readers in flight are told, so they stop early; the blocks stay pinned until each of them reports
        # Done (its reads settled) or its lease runs out.
        if e.state is not EntryState.CANCELLING:
            e.advance(EntryState.CANCELLING)
        frame = m.Error(m.ErrorCode.CANCELLED.value, f"request {c.rid} was cancelled on the context side", c.rid,
                        "cancel").encode()
        for ident in e.readers_waiting():
            self._send(ident, frame)

    def _finish(self, e: Entry, status: EntryState, detail: str) -> None:
        e.advance(status)
        self._readers.ended(len(e.readers_waiting()))  # readers that never reported Done (expired, cancelled)
        self._entries.pop(e.rid, None)
        self._jobs.release(e)  # a slot still being packed is freed by its pack's callback
        self._tomb[e.rid] = Tomb(status, e.secret, frozenset(e.fetched.values()))
        while len(self._tomb) > _TOMBSTONES:
            self._tomb.popitem(last=False)
        self._set_pinned()
        metrics.on_sent(status.value)
        self._report(SendResult(e.rid, status.value, detail, len(e.fetched)))
        log.debug("request %d %s on ctx rank %d: %s", e.rid, status, self.pool.rank, detail)

    def _set_pinned(self) -> None:
        with self._count_lock:
            self._npinned = len(self._entries)
        metrics.set_pinned(self.pool.rank, self._npinned)

    def _expire(self, now: float) -> None:
        for rid, ident, msg in self._early.expired(now):
            self._unknown(ident, rid, "fetch", msg.secret)
        if self._sessions.sweep_due(now):
            self._sessions.sweep(now, self._busy_peers())
        # A request some expected reader has not fetched yet waits for it up to the pickup timeout, even when
        # the readers that came are done (their lease alone would release it early).
        for e in [e for e in self._entries.values() if now > e.deadline and not (
                (not e.expected or e.expected - set(e.fetched))
                and now <= e.published_at + self.config.pickup_timeout_s)]:
            what = "no generation rank fetched it" if not e.fetched else "readers stopped renewing the lease"
            self._finish(e, EntryState.EXPIRED, f"lease expired: {what}")

    def _busy_peers(self) -> set[bytes]:
        """Identities with a read in flight here (or a Fetch waiting): their sessions are kept however quiet."""
        busy = {i for e in self._entries.values() for g, i in e.fetched.items() if g not in e.done}
        busy.update(self._early.idents())
        return busy

    def _send(self, ident: bytes, frame: bytes) -> None:
        self._outbox.add(ident, frame)  # sent at the end of this loop turn

    def _send_parts(self, ident: bytes, frames: list[bytes]) -> None:
        try:
            self._router.send_multipart([ident, *frames], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # peer vanished (ROUTER_MANDATORY) or queue full
            if e.errno == zmq.EHOSTUNREACH:
                self._sessions.drop(ident)  # it disconnected: its session goes with it
            log.info("cannot send to peer %r: %s", ident[:64], e)

    def _error(self, ident: bytes, code: m.ErrorCode, text: str, rid: int = -1, reply_to: str = "") -> None:
        self._send(ident, m.Error(code.value, text, rid, reply_to).encode())

    def _on_frames(self, frames: list[bytes]) -> None:
        """One ZeroMQ message: the peer's identity, then up to MAX_BATCH wire messages, each handled alone."""
        ident = frames[0]
        if 2 <= len(frames) <= m.MAX_BATCH + 1:
            self._sessions.heard(ident, time.monotonic())
        refused = each_part(frames[1:], lambda frame: self._on_frame(ident, frame), repr(ident[:64]))
        if refused:
            self._error(ident, m.ErrorCode.MALFORMED, refused)

    def _on_frame(self, ident: bytes, frame: bytes) -> None:
        try:
            msg = m.decode(frame)
        except ProtocolError as e:
            code = m.ErrorCode.VERSION if "protocol version" in str(e) else m.ErrorCode.MALFORMED
            log.info("bad frame from %r: %s", ident, e)
            self._error(ident, code, str(e))
            return
        handler = self._handlers.get(type(msg))
        if handler is None:
            self._error(ident, m.ErrorCode.MALFORMED, f"a context rank does not accept {msg.TYPE!r} messages",
                        reply_to=msg.TYPE)
            return
        handler(ident, msg)

    def _on_hello(self, ident: bytes, msg: m.Hello) -> None:
        try:
            gen_layout = check_hello(self.layout, msg)
        except LayoutMismatchError as e:
            self._error(ident, m.ErrorCode.LAYOUT_MISMATCH, str(e), reply_to="hello")
            return
        except ProtocolError as e:
            self._error(ident, m.ErrorCode.MALFORMED, str(e), reply_to="hello")
            return
        if not self._sessions.add(ident, Session(msg.gen_instance, msg.gen_rank, gen_layout), self._busy_peers):
            n = len(self._sessions)
            self._refused.refused(repr(ident[:32]), "sessions", f"{n} sessions already (transceiver.max_sessions)")
            self._error(ident, m.ErrorCode.BUSY, f"context rank {self.pool.rank} already holds {n} sessions "
                        f"(transceiver.max_sessions); try again later", reply_to="hello")
            return
        self._send(ident, self._welcome)

    def _session(self, ident: bytes, msg: m.Message, rid: int) -> Session | None:
        s = self._sessions.get(ident)
        if s is None:
            self._error(ident, m.ErrorCode.NO_SESSION, f"{msg.TYPE} before hello on this connection", rid, msg.TYPE)
        return s

    def _unknown(self, ident: bytes, rid: int, reply_to: str, secret: bytes = b"") -> None:
        code, text = unknown_answer(self._tomb.get(rid), secret, rid, self.pool.rank, self.config.publish_wait)
        self._error(ident, code, text, rid, reply_to)

    def _on_fetch(self, ident: bytes, msg: m.Fetch) -> None:
        s = self._session(ident, msg, msg.ctx_request_id)
        if s is None:
            return
        e = self._entries.get(msg.ctx_request_id)
        if e is None or not hmac.compare_digest(e.secret, msg.secret):  # a wrong secret is an unknown id
            tomb = self._tomb.get(msg.ctx_request_id)
            if (tomb is not None and hmac.compare_digest(tomb.secret, msg.secret)) or self._early.full:
                self._unknown(ident, msg.ctx_request_id, "fetch", msg.secret)
            else:  # not published yet (the executor publishes after its step): answer when it is, or time out
                self._early.add(msg.ctx_request_id, time.monotonic() + self.config.publish_wait, ident, msg)
                self._drain_commands()  # a publish queued without a wake (it saw no Fetch waiting) serves it now
            return
        bad = e.admit(s.instance, s.gen_rank, msg, self.pool.rank,
                      lambda: mapping_for(self.layout, s.layout).readers_of(self.pool.rank))
        if bad is not None:
            self._error(ident, bad[0], bad[1], e.rid, "fetch")
            return
        if not msg.done and s.gen_rank not in e.fetched:
            self._readers.started()
        e.fetched[s.gen_rank] = ident
        if e.state is EntryState.PUBLISHED:
            e.advance(EntryState.READING)
        with self._count_lock:
            self._nfetched += 1
        e.read_from[s.gen_rank] = msg.from_token
        e.deadline = time.monotonic() + self.config.lease_s
        if msg.done:  # its reads already finished: this Fetch is its Done(ok) too, confirmed like any
            self._reader_done(ident, e, s.gen_rank, True, "", True, "", counted=False)
            return
        if msg.read_ahead:
            return  # its reads are posted: no Blocks; its Done is confirmed like any reader's
        if msg.staged and self.pool.arena is not None and self._jobs.stage(ident, e, s, msg.from_token):
            return  # Blocks goes out once the layers ready so far are packed (SenderJobs)
        self._send(ident, m.Blocks(e.rid, e.blocks, e.num_tokens, e.layers_ready, self.config.lease_s).encode())

    def _on_heartbeat(self, ident: bytes, msg: m.Heartbeat) -> None:
        try:
            ids = m.int_list(msg.ctx_request_ids, "heartbeat", 100000)
        except ProtocolError as e:
            self._error(ident, m.ErrorCode.MALFORMED, str(e), reply_to="heartbeat")
            return
        alive = renew_leases(self._entries, self._early, ident, ids, time.monotonic() + self.config.lease_s)
        if any(alive):
            self._readers.renew()
        self._send(ident, m.HeartbeatAck(ids, alive).encode())

    def _on_done(self, ident: bytes, msg: m.Done) -> None:
        s = self._session(ident, msg, msg.ctx_request_id)
        if s is None:
            return
        e = self._entries.get(msg.ctx_request_id)
        if e is None and not msg.ok and self._early.withdraw(msg.ctx_request_id, ident, msg.error):
            self._send(ident, m.DoneAck(msg.ctx_request_id, False, "withdrawn before the publish").encode())
            return
        if e is None or e.fetched.get(s.gen_rank) != ident:
            tomb = self._tomb.get(msg.ctx_request_id)
            status = tomb.status if tomb is not None and ident in tomb.readers else "unknown"  # readers only
            self._send(ident, m.DoneAck(msg.ctx_request_id, False, f"blocks no longer pinned ({status})").encode())
            return
        if msg.ok and msg.digests:  # verification mode: hash off the I/O thread, then answer
            e.deadline = float("inf")  # pinned while we hash
            self._jobs.verify(e, s, msg.digests, lambda intact, why, g=s.gen_rank: self._reader_done(
                ident, e, g, intact, why, intact, why))
            return
        self._reader_done(ident, e, s.gen_rank, msg.ok, msg.error, True, "")

    def _reader_done(self, ident: bytes, e: Entry, gen_rank: int, ok: bool, error: str, intact: bool,
                     why: str, counted: bool = True, ack: bool = True) -> None:
        """`ack`: answer the reader (not for a Done it sent before the publish: that one was answered then)."""
        self._readers.ended(1 if counted and gen_rank not in e.done else 0)
        e.done[gen_rank] = ok
        self._jobs.release(e, gen_rank)
        if ack:
            self._send(ident, m.DoneAck(e.rid, True, why, intact).encode())
        if not ok:
            log.info("request %d: generation rank %d failed its read: %s", e.rid, gen_rank, error)
        if e.cancel_requested and not e.active_readers:
            self._finish(e, EntryState.CANCELLED, "cancelled; readers in flight finished")
        elif e.expected <= set(e.done):
            if all(e.done.values()):
                self._finish(e, EntryState.COMPLETE, "all readers confirmed")
            else:
                self._finish(e, EntryState.FAILED, "a generation rank reported a failed read")
