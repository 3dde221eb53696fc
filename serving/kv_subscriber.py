"""The router's side of the workers' KV events: subscribe, check, order, repair, and feed the KvIndex.

One thread owns every socket: per worker a SUB (the worker's PUB) and a DEALER (its replay ROUTER), both
proving they belong with the deployment's internal token: a CURVE client (the key pair derived from the token,
executor/kv_curve.py) of the worker's advertised `curve_server_key` when it runs CurveZMQ, else ZAP PLAIN with
kv_events.subscriber_password. With `require_curve` (the deployment's control plane is Curve) a worker that
advertises no Curve key is not followed (a downgrade to PLAIN is refused, logged). Per worker:

    sync_worker(name, info)   info = the worker's /health "kv_events" ({pub, replay, incarnation}); a new
                              incarnation or endpoint drops what was known and starts over: connect, then a
                              full dump (the index takes the worker's blocks and the seq they reflect)
    each batch                refused unless its signature verifies (a forged stream changes nothing and is
                              counted); an older seq is skipped; a newer one than expected is a gap: the
                              missing range is replayed first (or, gone from the worker's buffer, a dump)
    quiet for IDLE_CHECK_S    the replay socket is asked for anything after the last seq (a lost tail)
    remove_worker(name)       the worker left: sockets closed, its blocks dropped

Every wait is bounded (poll timeouts; a replay answer within replay_timeout_s, else the worker is resynced
later). `drop_seqs` is fault injection for tests (batches discarded as if the network lost them).
"""

from __future__ import annotations

import hmac
import itertools
import logging
import queue
import threading
import time

import zmq

from .. import codec
from ..errors import KvBridgeError, ProtocolError
from ..executor.kv_curve import set_client, subscriber_keys
from ..executor.kv_events import KV_EVENTS_VERSION, decode_batch, parse_topic, sign, subscriber_password
from ..executor.kv_publisher import ZAP_USER
from .kv_index import KvIndex

__all__ = ["IDLE_CHECK_S", "KvEventsClient"]

log = logging.getLogger("kvbridge.serving.kv_events")

IDLE_CHECK_S = 1.0
POLL_MS = 50
MAX_REPLY = 64 << 20


class _Conn:
    def __init__(self, name: str, info: dict, sub: zmq.Socket, dealer: zmq.Socket) -> None:
        self.name, self.info, self.sub, self.dealer = name, info, sub, dealer
        self.next = 1           # the seq expected next
        self.synced = False     # a dump was loaded
        self.last = 0.0         # monotonic time of the last batch or check (future: backing off)
        self.fails = 0          # replay exchanges failed in a row


class KvEventsClient:
    """Keeps `index` in step with the workers' KV events.

    Args:
        index: the index to feed.
        secret: kv_events.derive_secret(the deployment's internal token).
        replay_timeout_s: bound on one replay/dump answer.
        drop_seqs: fault injection: {worker name: set of seqs} discarded on arrival (tests only).
        require_curve: follow only workers whose events run CurveZMQ (their info names a curve_server_key).
    """

    def __init__(self, index: KvIndex, secret: bytes, replay_timeout_s: float = 5.0,
                 drop_seqs: dict[str, set[int]] | None = None, require_curve: bool = False) -> None:
        self.index, self.secret = index, secret
        self.require_curve = require_curve
        self._curve_keys = subscriber_keys(secret)
        self.replay_timeout_s = float(replay_timeout_s)
        self.drop_seqs = drop_seqs or {}
        self.stats = {"batches": 0, "gaps_repaired": 0, "dumps": 0, "rejected": 0, "event_lag_s": 0.0}
        self._ctx = zmq.Context()
        self._cmds: queue.Queue = queue.Queue()
        self._conns: dict[str, _Conn] = {}
        self._ids = itertools.count(1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kvbridge-kv-events")
        self._thread.start()

    # --- any thread -------------------------------------------------------------------------------------
    def sync_worker(self, name: str, info: dict) -> None:
        """Track worker `name` at `info` (its /health kv_events); a no-op when nothing changed."""
        self._cmds.put(("sync", name, dict(info)))

    def remove_worker(self, name: str) -> None:
        self._cmds.put(("remove", name, None))

    def barrier(self, timeout: float) -> bool:
        """Wait (bounded) until every worker's replay socket was asked for anything after the last batch
        applied: the index then reflects every event published before the call. False on timeout."""
        done = threading.Event()
        self._cmds.put(("barrier", "", done))
        return done.wait(timeout)

    def synced(self, name: str) -> bool:
        c = self._conns.get(name)
        return c is not None and c.synced

    def last_seq(self, name: str) -> int:
        c = self._conns.get(name)
        return c.next - 1 if c is not None else 0

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.replay_timeout_s + 2)

    # --- the event thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        try:
            while not self._stop.is_set():
                self._commands(poller)
                for sock, _ in poller.poll(POLL_MS):
                    c = next((x for x in self._conns.values() if x.sub is sock), None)
                    if c is not None:
                        self._drain(c)
                now = time.monotonic()
                for c in list(self._conns.values()):
                    if now - c.last > IDLE_CHECK_S:
                        c.last = now
                        self._catch_up(c)
        except Exception:  # the router keeps routing (by load) without an index
            log.exception("kv events: the subscriber thread failed")
        finally:
            for c in self._conns.values():
                c.sub.close(0)
                c.dealer.close(0)
            self._ctx.term()

    def _commands(self, poller: zmq.Poller) -> None:
        while True:
            try:
                op, name, info = self._cmds.get_nowait()
            except queue.Empty:
                return
            if op == "barrier":
                for c in list(self._conns.values()):
                    self._drain(c)
                    self._catch_up(c)
                info.set()
                continue
            old = self._conns.get(name)
            if op == "sync" and old is not None and old.info == info:
                continue
            if old is not None:
                poller.unregister(old.sub)
                old.sub.close(0)
                old.dealer.close(0)
                del self._conns[name]
                self.index.remove_worker(name)
            if op == "sync":
                if self.require_curve and not info.get("curve_server_key"):
                    log.warning("kv events: not following %s: its events are not on CurveZMQ, and this "
                                "deployment's control plane is", name)
                    continue
                try:
                    sub = self._socket(zmq.SUB, info)
                    try:
                        c = _Conn(name, info, sub, self._socket(zmq.DEALER, info))
                    except BaseException:
                        sub.close(0)
                        raise
                except (zmq.ZMQError, KvBridgeError) as e:
                    log.warning("kv events: cannot follow %s at %s: %s", name, info, e)
                    continue
                c.sub.setsockopt(zmq.SUBSCRIBE, b"")
                poller.register(c.sub, zmq.POLLIN)
                self._conns[name] = c
                self._resync(c)

    def _socket(self, kind: int, info: dict) -> zmq.Socket:
        s = self._ctx.socket(kind)
        try:
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY)
            if info.get("curve_server_key"):
                set_client(s, info["curve_server_key"], self._curve_keys)
            else:
                s.plain_username = ZAP_USER.encode()
                s.plain_password = subscriber_password(self.secret)
            if kind == zmq.SUB:
                s.setsockopt(zmq.RCVHWM, 100000)
            s.connect(info["pub" if kind == zmq.SUB else "replay"])
        except BaseException:
            s.close(0)
            raise
        return s

    def _drain(self, c: _Conn) -> None:
        for _ in range(1000):
            try:
                frames = c.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if c.name not in self._conns:
                return
            self._on_batch(c, frames)

    def _on_batch(self, c: _Conn, frames: list[bytes]) -> None:
        try:
            if len(frames) != 3:
                raise ProtocolError(f"kv event: expected 3 frames, got {len(frames)}")
            inc, seq = parse_topic(self.secret, *frames)
            batch = decode_batch(frames[2])
        except ProtocolError as e:
            self.stats["rejected"] += 1
            if self.stats["rejected"] % 100 == 1:
                log.warning("kv events from %s refused: %s", c.name, e)
            return
        if seq in self.drop_seqs.get(c.name, ()):
            return  # fault injection: lost on the way
        c.last = time.monotonic()
        if inc != c.info.get("incarnation") or not c.synced:
            self._resync(c)  # a restarted worker (its /health will say so too) or a dump still owed
            return
        if seq < c.next:
            return
        if seq > c.next and not self._repair(c, c.next, seq - 1):
            return
        self._apply(c, seq, batch)

    def _apply(self, c: _Conn, seq: int, batch) -> None:
        self.index.apply(c.name, seq, batch)
        c.next = seq + 1
        self.stats["batches"] += 1
        self.stats["event_lag_s"] = max(0.0, time.time() - batch.ts)

    def _repair(self, c: _Conn, start: int, end: int) -> bool:
        """Replay batches start..end; a dump when they are gone. True when the index is in step again."""
        got = self._ask(c, {"op": "range", "start": start, "end": end})
        if got is None:
            c.synced = False
            return False
        if got.get("missing") or not self._apply_range(c, got, end):
            return self._resync(c)
        self.stats["gaps_repaired"] += 1
        return True

    def _catch_up(self, c: _Conn) -> None:
        if not c.synced:
            self._resync(c)
            return
        got = self._ask(c, {"op": "range", "start": c.next, "end": c.next + (1 << 40)})
        if got is None:
            return
        if got.get("missing"):
            self._resync(c)
        elif got.get("batches"):
            if self._apply_range(c, got, None):
                self.stats["gaps_repaired"] += 1
            else:
                self._resync(c)

    def _apply_range(self, c: _Conn, got: dict, end: int | None) -> bool:
        try:
            for item in got.get("batches") or []:
                seq, payload = item
                if type(seq) is not int or not isinstance(payload, bytes) or seq != c.next:
                    return False
                self._apply(c, seq, decode_batch(payload))
        except (ProtocolError, ValueError, TypeError):
            return False
        return end is None or c.next == end + 1

    def _resync(self, c: _Conn) -> bool:
        got = self._ask(c, {"op": "dump"})
        if got is None or not isinstance(got.get("blocks"), list) or type(got.get("seq")) is not int:
            c.synced = False
            return False
        fp, bs = got.get("fingerprint"), got.get("block_size")
        if not isinstance(fp, str) or type(bs) is not int or bs < 1:
            c.synced = False
            return False
        blocks = []
        for b in got["blocks"]:
            if not isinstance(b, list) or len(b) != 3 or not isinstance(b[0], bytes) or \
                    not (b[1] is None or isinstance(b[1], bytes)):
                c.synced = False
                return False
            blocks.append(b)
        self.index.add_worker(c.name, fp, bs, str(got.get("incarnation")))
        self.index.load_dump(c.name, got["seq"], blocks)
        c.info["incarnation"] = got.get("incarnation")
        c.next, c.synced = got["seq"] + 1, True
        self.stats["dumps"] += 1
        return True

    def _ask(self, c: _Conn, req: dict) -> dict | None:
        """One signed replay exchange; None (logged) when it fails or takes longer than replay_timeout_s."""
        rid = next(self._ids)
        try:
            c.dealer.send_multipart([b"", codec.pack({"v": KV_EVENTS_VERSION, "id": rid, **req})], zmq.NOBLOCK)
        except zmq.Again:
            return None
        deadline = time.monotonic() + self.replay_timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not c.dealer.poll(int(left * 1000) + 1):
                break
            frames = c.dealer.recv_multipart()
            try:
                if len(frames) != 3 or frames[0] != b"":
                    raise ProtocolError("kv replay: expected [b'', reply, mac]")
                body = codec.unpack(frames[1], max_bytes=MAX_REPLY, max_container=1 << 20, what="kv replay")
                if not isinstance(body, dict) or not isinstance(body.get("incarnation"), str):
                    raise ProtocolError("kv replay: the reply is not a map naming its incarnation")
                if not hmac.compare_digest(sign(self.secret, body["incarnation"].encode(), frames[1]), frames[2]):
                    raise ProtocolError("kv replay: bad signature")
            except ProtocolError as e:
                self.stats["rejected"] += 1
                log.warning("kv replay from %s refused: %s", c.name, e)
                return None
            if body.get("id") != rid and "error" not in body:
                continue  # a late answer to an earlier request
            if "error" in body:
                log.warning("kv replay from %s: %s", c.name, str(body["error"])[:200])
                return None
            c.fails = 0
            return body
        log.warning("kv replay from %s: no answer within %.1f s", c.name, self.replay_timeout_s)
        c.fails += 1  # a silent worker is asked less and less often (its health check drops it meanwhile)
        c.last = time.monotonic() + min(30.0, 2.0 ** c.fails)
        return None
