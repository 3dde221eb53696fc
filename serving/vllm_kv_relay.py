"""vLLM's own KV events, relayed as kvbridge's: what `policy: kv_aware` routes by when the workers are vLLM
servers (`engine: vllm`).

A vLLM server started with `--kv-events-config` publishes its prefix cache's events (BlockStored,
BlockRemoved, AllBlocksCleared: vllm/distributed/kv_events.py) on a ZeroMQ PUB without any authentication.
Its `kvbridge worker` (vllm_member.py) has it bind that PUB to an ipc socket in a private (0700) folder on
its own host, so nothing on the network reaches it, subscribes there, and republishes every event through
kvbridge's publisher (executor/kv_publisher.py: ZAP PLAIN or CurveZMQ, HMAC-signed batches, a replay and
dump socket). The router then follows a vLLM server exactly as it follows a kvbridge worker
(kv_subscriber.py, kv_index.py).

    vLLM EngineCore --PUB ipc://<0700 dir>/vllm-kv-events--> relay (SUB) --signed PUB + replay--> routers

Keys: vLLM's block hashes depend on its hash algorithm and a per-process seed (and are 64-bit ints by
default, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES), while the router computes kvbridge's chained keys
(prefix_tree.chain_keys) from a prompt's token ids. So the relay recomputes each stored block's key from the
event's token_ids and its parent's key, and keeps vLLM hash -> key for the removals. The fingerprint is
`vllm:<served model name>:<block size>`: the same on every server of one deployment.

Not indexed (token-only keys would claim them wrongly): blocks with extra keys (LoRA, multimodal, a cache
salt, prompt embeddings), those of a KV cache group other than the first, those of another block size, and
those whose parent the relay never saw. A gap in vLLM's sequence numbers (a batch dropped) is filled from
vLLM's replay socket (a ROUTER on another ipc socket of the same folder, its last 10,000 batches): the
missing batches are applied in order and their copies arriving later on the SUB are skipped. A replay that
does not answer within REPLAY_TIMEOUT_S, or no longer holds the first missing batch, clears the mirror and
says so (AllBlocksCleared): the router then under-estimates this server, a worse route, never a wrong one,
until new stores arrive. Malformed input is counted and skipped, never raised into the loop.

One thread, the relay's: it waits on the SUB (bounded), applies, and flushes the publisher, which also
answers the router's dumps from `snapshot` on this thread (kv_publisher.KVEventPublisher.flush).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import zmq

from .. import codec
from ..errors import ProtocolError
from ..executor.kv_publisher import KVEventPublisher
from ..kvcache.prefix_tree import block_key, root_key

__all__ = ["DEFAULT_BLOCK_SIZE", "VllmKvMirror", "VllmKvRelay", "fingerprint", "kv_events_config"]

log = logging.getLogger("kvbridge.serving.vllm_kv_relay")

DEFAULT_BLOCK_SIZE = 128  # vLLM's own on CPU; passed to vLLM explicitly so the relay knows it
POLL_MS = 50
MAX_BATCH_BYTES = 16 << 20
MAX_HASH_BYTES = 64
REPLAY_TIMEOUT_S = 2.0  # one replay request's answer, whole (the relay's thread waits this long at most)
MAX_REPLAY_BATCHES = 10_000  # vLLM's own replay buffer holds this many
MAX_REPLAY_BYTES = 256 << 20  # one replay's answer, all batches together


def fingerprint(model_name: str, block_size: int) -> str:
    return f"vllm:{model_name}:{int(block_size)}"


def kv_events_config(endpoint: str, replay: str | None = None) -> dict:
    """vLLM's `--kv-events-config` for a server whose events the relay reads at `endpoint` (ipc://), with its
    replay socket at `replay` (ipc://) when given."""
    out = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": ""}
    return {**out, "replay_endpoint": replay} if replay else out


def _hash(v: Any, what: str) -> bytes | int:
    if isinstance(v, bytes) and 0 < len(v) <= MAX_HASH_BYTES:
        return v
    if type(v) is int and 0 <= v < 1 << 64:
        return v
    raise ProtocolError(f"{what}: a block hash must be 1..{MAX_HASH_BYTES} bytes or a 64-bit int")


def _hashes(v: Any, what: str) -> list:
    if not isinstance(v, list) or not v:
        raise ProtocolError(f"{what}: expected a non-empty list of block hashes")
    return [_hash(h, what) for h in v]


def _plain(e: dict) -> bool:
    """Whether a stored run's keys are its tokens alone (no LoRA, extra keys, or other cache group)."""
    extra = e.get("extra_keys")
    return (e.get("lora_id") is None and e.get("lora_name") is None and e.get("group_idx") in (None, 0)
            and (extra is None or (isinstance(extra, list) and all(x is None for x in extra))))


class VllmKvMirror:
    """vLLM's prefix cache as kvbridge keys: the `tree` a KVEventPublisher listens to (fingerprint, tpb,
    listener, snapshot). Single-threaded: the relay's thread calls everything."""

    def __init__(self, fp: str, block_size: int) -> None:
        self.fingerprint, self.tpb = fp, int(block_size)
        self.root = root_key(fp)
        self.listener = None  # the publisher's KVEventLog
        self._by_hash: dict[bytes | int, bytes] = {}        # vLLM hash -> kvbridge key
        self._blocks: dict[bytes, list] = {}                # key -> [parent, tokens, its vLLM hashes]
        self.skipped = 0                                     # blocks not indexed (see the module's note)

    def __len__(self) -> int:
        return len(self._blocks)

    def snapshot(self) -> list[tuple[bytes, bytes, int]]:
        return [(k, b[0], self.tpb) for k, b in self._blocks.items()]

    def apply(self, ev: Any, i: int) -> None:
        """One vLLM event (a msgpack map tagged by "type"); ProtocolError naming the field when malformed."""
        what = f"events[{i}]"
        if not isinstance(ev, dict) or not isinstance(ev.get("type"), str):
            raise ProtocolError(f"{what}: expected a map tagged by 'type'")
        kind = ev["type"]
        if kind == "BlockStored":
            self._stored(ev, what)
        elif kind == "BlockRemoved":
            hashes = _hashes(ev.get("block_hashes"), f"{what}.block_hashes")
            if ev.get("group_idx") in (None, 0):
                for h in hashes:
                    self._removed(h)
        elif kind == "AllBlocksCleared":
            self.clear()
        else:
            raise ProtocolError(f"{what}: unknown event {kind[:40]!r}")

    def clear(self) -> None:
        self._by_hash.clear()
        self._blocks.clear()
        if self.listener is not None:
            self.listener.cleared()

    def _stored(self, ev: dict, what: str) -> None:
        hashes = _hashes(ev.get("block_hashes"), f"{what}.block_hashes")
        parent, toks, bs = ev.get("parent_block_hash"), ev.get("token_ids"), ev.get("block_size")
        if parent is not None:
            parent = _hash(parent, f"{what}.parent_block_hash")
        if type(bs) is not int or bs < 1:
            raise ProtocolError(f"{what}.block_size: expected a positive int")
        if not isinstance(toks, list) or len(toks) != bs * len(hashes) or \
                any(type(t) is not int or t < 0 for t in toks):
            raise ProtocolError(f"{what}.token_ids: expected {bs * len(hashes)} non-negative ints")
        pkey = self.root if parent is None else self._by_hash.get(parent)
        if bs != self.tpb or pkey is None or not _plain(ev):
            self.skipped += len(hashes)
            return
        for j, h in enumerate(hashes):
            chunk = tuple(toks[j * bs:(j + 1) * bs])
            key = block_key(pkey, chunk)
            old = self._by_hash.get(h)
            if old is not None and old != key:
                self._removed(h)
            self._by_hash[h] = key
            b = self._blocks.get(key)
            if b is None:
                self._blocks[key] = [pkey, chunk, {h}]
                if self.listener is not None:
                    self.listener.stored(key, pkey, chunk)
            else:
                b[2].add(h)
            pkey = key

    def _removed(self, h: bytes | int) -> None:
        key = self._by_hash.pop(h, None)
        b = self._blocks.get(key) if key is not None else None
        if b is None:
            return
        b[2].discard(h)
        if not b[2]:
            del self._blocks[key]
            if self.listener is not None:
                self.listener.removed(key)


class VllmKvRelay:
    """Subscribes to one vLLM server's events at `source` (ipc://) and republishes them signed.

    Args:
        settings: the publisher's settings (kv_worker.kv_events_settings: secret, incarnation, host,
            endpoint_file, and curve_secret_key_file under CurveZMQ).
        model_name: the served model name (the fingerprint's).
        block_size: vLLM's --block-size (passed to it explicitly).
        replay: vLLM's replay socket (ipc://; its `replay_endpoint`), asked for the batches of a gap; None:
            a gap clears the mirror.
    """

    def __init__(self, settings: dict, source: str, model_name: str, block_size: int,
                 replay: str | None = None) -> None:
        self.mirror = VllmKvMirror(fingerprint(model_name, block_size), block_size)
        self.publisher = KVEventPublisher(settings, self.mirror, "GPU")
        self.stats = {"batches": 0, "gaps": 0, "rejected": 0, "replayed": 0, "duplicates": 0}
        self._last_seq: int | None = None
        self._dups = range(0)  # seqs a replay applied ahead of the SUB: their copies there are skipped
        self._replay_at = replay
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._dealer: zmq.Socket | None = None
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES)
        self._sub.setsockopt(zmq.RCVHWM, 100000)  # as vLLM's PUB: the default 1,000 would drop a burst
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(source)  # before vLLM binds: ZeroMQ connects when it does, so no batch is missed
        self._thread = threading.Thread(target=self._run, daemon=True, name="kvbridge-vllm-kv-relay")
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.publisher.close()
        self._ctx.destroy(linger=0)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._sub.poll(POLL_MS):
                    for _ in range(256):  # then flush, so a burst goes out in one batch
                        try:
                            frames = self._sub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_frames(frames)
                self.publisher.flush()  # (also answers the router's dumps)
        except zmq.ZMQError as e:
            if not self._stop.is_set():
                log.warning("vLLM kv events relay: the subscription failed: %s", e)
        finally:
            self._sub.close(0)
            if self._dealer is not None:
                self._dealer.close(0)

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.stats["rejected"] += 1
            return
        seq, last = int.from_bytes(frames[1], "big"), self._last_seq
        if seq in self._dups:  # a replay applied it already
            self.stats["duplicates"] += 1
            return
        if last is not None and seq != last + 1:
            if seq > last + 1 and self._fill(last + 1, seq):
                return
            self.mirror.clear()  # dropped and not replayed, or a restarted publisher: start clean
            self.stats["gaps"] += 1  # (after the clear, as for a refused batch)
            log.warning("vLLM kv events: batch %d after %d; the relayed cache starts over", seq, last)
        self._last_seq = seq
        self._apply(frames[2])

    def _fill(self, first: int, seq: int) -> bool:
        """Batches `first` .. `seq` (and any later one vLLM has) from its replay socket, applied in order;
        False (nothing applied) when the replay is off, silent, or no longer holds `first`."""
        got = self._replay(first)
        if not got or [s for s, _ in got] != list(range(first, first + len(got))) or got[-1][0] < seq:
            return False  # (the answer must run on from `first` without a hole, through `seq`)
        for s, payload in got:
            self._apply(payload)
        self._last_seq, self._dups = got[-1][0], range(seq + 1, got[-1][0] + 1)
        self.stats["replayed"] += len(got)
        log.info("vLLM kv events: batches %d-%d replayed after a gap", first, got[-1][0])
        return True

    def _replay(self, first: int) -> list[tuple[int, bytes]] | None:
        """vLLM's buffered batches from `first` on ((seq, payload), in its order), or None (bounded wait)."""
        if self._replay_at is None:
            return None
        if self._dealer is None:
            self._dealer = self._ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES)
            self._dealer.connect(self._replay_at)
        self._dealer.send_multipart([b"", first.to_bytes(8, "big")])
        got: list[tuple[int, bytes]] = []
        size, deadline = 0, time.monotonic() + REPLAY_TIMEOUT_S
        while True:
            left = deadline - time.monotonic()
            if left > 0 and self._dealer.poll(max(1, int(left * 1000))):
                frames = self._dealer.recv_multipart()  # [b"", topic, seq, payload]; seq -1: the end
                size += sum(len(f) for f in frames)
                if len(frames) == 4 and len(frames[2]) == 8 and len(got) <= MAX_REPLAY_BATCHES \
                        and size <= MAX_REPLAY_BYTES:
                    s = int.from_bytes(frames[2], "big", signed=True)
                    if s == -1:
                        return got
                    got.append((s, frames[3]))
                    continue
            # silent, malformed or too long: a later answer to this request must not meet the next one
            log.warning("vLLM kv events: the replay of batches from %d failed", first)
            self._dealer.close(0)
            self._dealer = None
            return None

    def _apply(self, payload: bytes) -> None:
        try:
            batch = codec.unpack(payload, max_bytes=MAX_BATCH_BYTES, what="vLLM kv event batch")
            if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
                raise ProtocolError("vLLM kv event batch: expected [ts, events, data_parallel_rank]")
            for i, ev in enumerate(batch[1]):
                self.mirror.apply(ev, i)
        except Exception as e:  # noqa: BLE001 - malformed, or a bug on odd input: never the relay's end
            self.mirror.clear()  # part of it may have been applied: nothing known is trusted
            self.stats["rejected"] += 1  # counted after the clear: whoever sees the count sees the cleared cache
            log.warning("vLLM kv events: a batch refused (%s); the relayed cache starts over", e,
                        exc_info=not isinstance(e, ProtocolError))
            return
        self.stats["batches"] += 1
