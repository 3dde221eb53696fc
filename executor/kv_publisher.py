"""The leader rank's KV-event endpoints: a PUB socket of signed event batches and a replay ROUTER.

Lives in rank 0's process, beside the KVCacheManager whose prefix tree it listens to (every rank's allocator
is identical to rank 0's: plans are replayed on every rank, so rank 0's pool is every rank's pool as the
worker sees it). Two sockets, both behind ZAP: PLAIN (a subscriber presents kv_events.subscriber_password,
derived from the deployment's internal token) or, when the worker's control plane runs CurveZMQ
(`curve_secret_key_file` in the settings), CURVE with the worker's key pair, letting in only the client key
derived from the token (kv_curve.py); anyone else is refused at the handshake, before any frame:

    PUB     tcp://host:P   [topic, seq, payload] per batch (kv_events.py), dropped at the high-water mark
                           (a subscriber sees the gap by sequence number and asks the replay socket)
    ROUTER  tcp://host:R   [b"", request] -> [b"", reply, mac]; requests (codec msgpack maps):
                             {"v": 1, "op": "range", "start": s, "end": e}  the buffered batches s..e
                                 -> {"batches": [[seq, payload], ...], "last": seq, "missing": bool}
                                 ("missing": some of them fell out of the buffer: take a dump)
                             {"v": 1, "op": "dump"}   every block the prefix tree holds now, and the seq it
                                 reflects -> {"seq", "blocks": [[hash, parent|None, tokens], ...], ...}
                           every reply is signed (mac = HMAC of incarnation and reply) like the batches.

Threads: the leader's thread calls `flush` once per loop (numbers and sends the step's events, answers dump
requests from the tree it owns); one replay thread owns the ROUTER and waits, bounded, for dumps. The bound
endpoints are written to `endpoint_file` (JSON) for the worker process to advertise. Never touches the pool.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import deque

import zmq
from zmq.auth.thread import ThreadAuthenticator

from .. import codec
from ..errors import ProtocolError
from ..kvcache.prefix_tree import PrefixTree
from .kv_curve import KeyAllow, server_keys, set_server, subscriber_keys
from .kv_events import (
    KV_EVENTS_VERSION,
    KVEventLog,
    check_deterministic,
    make_topic,
    sign,
    subscriber_password,
)

__all__ = ["ZAP_DOMAIN", "ZAP_USER", "KVEventPublisher"]

log = logging.getLogger("kvbridge.executor.kv_events")

ZAP_DOMAIN = "kvbridge-kv"
ZAP_USER = "kvbridge"
BUFFER_BATCHES = 8192   # batches kept for replay
MAX_RANGE = 1024        # batches in one replay answer
DUMP_WAIT_S = 10.0      # the replay thread waits this long for the leader to snapshot its tree
POLL_MS = 100


class KVEventPublisher:
    """Publishes a prefix tree's events. Args: `cfg` (the executor's kv_events mapping: secret (hex),
    incarnation, host, endpoint_file, optional buffer), the rank-0 `tree`, the pool's `medium`.

    Raises:
        ExecutorError: the tree's hashes would not be deterministic (kv_events.check_deterministic).
    """

    def __init__(self, cfg: dict, tree: PrefixTree, medium: str) -> None:
        check_deterministic(tree.fingerprint)
        self.secret = bytes.fromhex(cfg["secret"])
        self.incarnation = str(cfg["incarnation"])
        self.tree = tree
        self.log = KVEventLog(tree.fingerprint, tree.tpb, medium)
        self.medium = medium
        tree.listener = self.log
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=int(cfg.get("buffer") or BUFFER_BATCHES))
        self._lock = threading.Lock()
        self._dumps: list[tuple[threading.Event, dict]] = []
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._auth = ThreadAuthenticator(self._ctx)
        self._auth.start()
        curve = cfg.get("curve_secret_key_file")
        self._curve = server_keys(curve) if curve else None
        if self._curve is not None:
            self._auth.configure_curve_callback(ZAP_DOMAIN, KeyAllow(subscriber_keys(self.secret)[0]))
        else:
            self._auth.configure_plain(domain=ZAP_DOMAIN,
                                       passwords={ZAP_USER: subscriber_password(self.secret).decode()})
        host = cfg.get("host") or "127.0.0.1"
        self._pub = self._socket(zmq.PUB, host)
        self._rep = self._socket(zmq.ROUTER, host)
        self.endpoints = {"pub": self._pub.getsockopt_string(zmq.LAST_ENDPOINT),
                          "replay": self._rep.getsockopt_string(zmq.LAST_ENDPOINT)}
        if self._curve is not None:  # what a subscriber's curve_serverkey must be
            self.endpoints["curve_server_key"] = self._curve[0].decode("ascii")
        path = cfg.get("endpoint_file")
        if path:
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.endpoints, f)
            os.replace(tmp, path)
        self._thread = threading.Thread(target=self._serve, daemon=True, name="kvbridge-kv-replay")
        self._thread.start()

    def _socket(self, kind: int, host: str) -> zmq.Socket:
        s = self._ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        if self._curve is not None:
            set_server(s, self._curve, ZAP_DOMAIN)
        else:
            s.plain_server = True
            s.zap_domain = ZAP_DOMAIN.encode()
        if kind == zmq.PUB:
            s.setsockopt(zmq.SNDHWM, 10000)
        s.bind(f"tcp://{host}:0")
        return s

    # --- the leader's thread -----------------------------------------------------------------------------
    def flush(self) -> None:
        """Send the events of the last step as one batch, and answer the dump requests waiting."""
        b = self.log.take_batch()
        if b is not None:
            seq, payload = b
            with self._lock:
                self._ring.append((seq, payload))
            try:
                self._pub.send_multipart([make_topic(self.secret, self.incarnation, seq, payload),
                                          seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
            except zmq.Again:  # a slow subscriber: it sees the gap and replays
                pass
        with self._lock:
            waiting, self._dumps = self._dumps, []
        if waiting:
            blocks = [[k, None if p == self.log.root else p, n] for k, p, n in self.tree.snapshot()]
            for ev, box in waiting:
                box.update(seq=self.log.seq, blocks=blocks)
                ev.set()

    def close(self) -> None:
        self._stop.set()
        with self._lock:  # nobody will snapshot the tree any more: waiting dumps fail now, not in 10 s
            waiting, self._dumps = self._dumps, []
        for ev, _box in waiting:
            ev.set()
        self._thread.join(timeout=2 * POLL_MS / 1000 + DUMP_WAIT_S)
        self._pub.close(0)
        self._auth.stop()
        self._ctx.term()

    # --- the replay thread ---------------------------------------------------------------------------------
    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._rep.poll(POLL_MS):
                    continue
                frames = self._rep.recv_multipart()
                if len(frames) != 3 or frames[1] != b"":
                    continue  # not [identity, b"", request]: nothing to answer
                try:
                    body = self._answer(frames[2])
                except ProtocolError as e:
                    body = {"error": str(e)[:300]}
                body.update(v=KV_EVENTS_VERSION, incarnation=self.incarnation)
                raw = codec.pack(body)
                self._rep.send_multipart([frames[0], b"", raw, sign(self.secret, self.incarnation.encode(), raw)])
        except zmq.ZMQError as e:  # the context is closing
            if not self._stop.is_set():
                log.warning("kv events: the replay socket failed: %s", e)
        finally:
            self._rep.close(0)

    def _answer(self, raw: bytes) -> dict:
        req = codec.unpack(raw, max_bytes=4096, what="kv replay request")
        if not isinstance(req, dict) or req.get("v") != KV_EVENTS_VERSION:
            raise ProtocolError(f"kv replay request: expected a map with v={KV_EVENTS_VERSION}")
        op, rid = req.get("op"), req.get("id")
        if type(rid) is int:  # echoed, so a client can tell a late answer to an older request
            return {"id": rid, **self._answer_op(op, req)}
        return self._answer_op(op, req)

    def _answer_op(self, op, req: dict) -> dict:
        if op == "range":
            start, end = req.get("start"), req.get("end")
            if type(start) is not int or type(end) is not int or start < 1 or end < start:
                raise ProtocolError("kv replay request: start and end must be ints, 1 <= start <= end")
            with self._lock:
                oldest = self._ring[0][0] if self._ring else self.log.seq + 1
                got = [[s, p] for s, p in self._ring if start <= s <= end][:MAX_RANGE]
                last = self._ring[-1][0] if self._ring else 0
            return {"op": "range", "batches": got, "last": last, "missing": start < oldest}
        if op == "dump":
            ev, box = threading.Event(), {}
            with self._lock:
                self._dumps.append((ev, box))
            if not ev.wait(DUMP_WAIT_S):
                raise ProtocolError(f"kv replay: the leader did not snapshot its cache within {DUMP_WAIT_S:g} s")
            return {"op": "dump", "fingerprint": self.tree.fingerprint, "block_size": self.tree.tpb,
                    "medium": self.medium, **box}
        raise ProtocolError(f"kv replay request: unknown op {str(op)[:40]!r}")
