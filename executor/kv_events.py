"""KV cache events of one worker, in vLLM's msgpack shape: what was stored, removed, cleared, and in what order.

A worker tells routers which KV blocks its pool holds, so they can send a prompt where its prefix already
sits. The shape is vLLM's (`vllm/distributed/kv_events.py`), so a vLLM-side subscriber reads ours:

    KVEventBatch = [ts: float, events: [event, ...], data_parallel_rank: int | None]
    BlockStored  = {"type": "BlockStored", "block_hashes": [bytes], "parent_block_hash": bytes | None,
                    "token_ids": [int], "block_size": int, "lora_id": None, "medium": str, "lora_name": None}
    BlockRemoved = {"type": "BlockRemoved", "block_hashes": [bytes], "medium": str}
    AllBlocksCleared = {"type": "AllBlocksCleared"}

(the batch is an array, each event a map tagged by "type": msgspec's encoding of vLLM's structs, checked by
decoding our bytes with vLLM's own `KVEventBatch`; older vLLM sent events as tagged arrays, which
`decode_batch` also reads).

A block hash is the prefix tree's chained key (kvcache/prefix_tree.py: blake2b over the parent key and the block's
tokens as little-endian int64, the chain rooted at a layout/model fingerprint): the same on every process
and host, never Python's `hash`. `parent_block_hash` is None for a prompt's first block (its parent is the
fingerprint's root). One BlockStored carries a run of chained blocks (each the parent of the next).

On the PUB socket each batch is three frames, as vLLM sends them: `topic`, `seq` (8 bytes big-endian, per
worker, +1 per batch, from 1), `payload`. Our topic is `kvbridge-kv|<incarnation>|<mac hex>`: the worker's
incarnation (new at every start: sequence numbers restart) and an HMAC-SHA256, under a key derived from the
deployment's internal token, of (incarnation, seq, payload), so a subscriber refuses a batch nobody of the
deployment signed. vLLM's subscribers ignore the topic's content.

Owns the format, the signatures and the event log (KVEventLog: pending events -> numbered batches); opens no
socket (kv_publisher.py does). Decoding goes through codec.unpack and validates every field.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass
from typing import Any

from .. import codec
from ..errors import ExecutorError, ProtocolError
from ..kvcache.prefix_tree import KEY_VERSION, chain_keys, root_key

__all__ = [
    "KV_EVENTS_VERSION",
    "REFERENCE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEventBatch",
    "KVEventLog",
    "check_deterministic",
    "decode_batch",
    "derive_secret",
    "encode_batch",
    "make_topic",
    "parse_topic",
    "sign",
    "subscriber_password",
]

KV_EVENTS_VERSION = 1  # bump when the batch, topic, replay or signature format changes
TOPIC_PREFIX = b"kvbridge-kv|"
MAX_HASH_BYTES = 64
# The reference vector (like Dynamo's fixed-seed xxh3 vectors): fingerprint "ref", tokens 0..7, 4 per block.
# Every process must compute exactly these keys; a worker that does not refuses to start.
REFERENCE = ("ref", list(range(8)), 4, ("2ad4a160b564b842a7349c8a039b2b8b", "5d15dbd07e82e700fe54bc797c7981ee"))


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: None = None
    medium: str = "CPU"


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[bytes, ...]
    medium: str = "CPU"


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None = None


def _event_wire(e: Event) -> dict:
    if isinstance(e, BlockStored):
        return {"type": "BlockStored", "block_hashes": list(e.block_hashes), "parent_block_hash":
                e.parent_block_hash, "token_ids": list(e.token_ids), "block_size": e.block_size,
                "lora_id": e.lora_id, "medium": e.medium, "lora_name": None}
    if isinstance(e, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(e.block_hashes), "medium": e.medium}
    return {"type": "AllBlocksCleared"}


_FIELDS = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
           "BlockRemoved": ("block_hashes", "medium"), "AllBlocksCleared": ()}


def encode_batch(b: KVEventBatch) -> bytes:
    return codec.pack([b.ts, [_event_wire(e) for e in b.events], b.data_parallel_rank])


def _hashes(v: Any, what: str) -> tuple[bytes, ...]:
    if not isinstance(v, list) or not v:
        raise ProtocolError(f"{what}: expected a non-empty list of block hashes")
    for h in v:
        if not isinstance(h, bytes) or not 0 < len(h) <= MAX_HASH_BYTES:
            raise ProtocolError(f"{what}: a block hash must be 1..{MAX_HASH_BYTES} bytes, got {type(h).__name__}")
    return tuple(v)


def _medium(v: Any, what: str) -> str:
    if not isinstance(v, str) or len(v) > 32:
        raise ProtocolError(f"{what}.medium: expected a short string")
    return v


def _event(w: Any, i: int) -> Event:
    what = f"events[{i}]"
    if isinstance(w, dict) and isinstance(w.get("type"), str) and w["type"] in _FIELDS:
        miss = [k for k in _FIELDS[w["type"]] if k not in w]
        if miss:
            raise ProtocolError(f"{what}: {w['type']} lacks {', '.join(miss)}")
        w = [w["type"], *(w[k] for k in _FIELDS[w["type"]])]
    if not isinstance(w, list) or not w or not isinstance(w[0], str):
        raise ProtocolError(f"{what}: expected {{'type': tag, fields...}}")
    tag = w[0]
    if tag == "BlockStored":
        if len(w) < 7:
            raise ProtocolError(f"{what}: BlockStored has 6 fields, got {len(w) - 1}")
        hashes = _hashes(w[1], f"{what}.block_hashes")
        parent = w[2]
        if parent is not None and (not isinstance(parent, bytes) or not 0 < len(parent) <= MAX_HASH_BYTES):
            raise ProtocolError(f"{what}.parent_block_hash: expected bytes or None")
        toks, bs = w[3], w[4]
        if type(bs) is not int or bs < 1:
            raise ProtocolError(f"{what}.block_size: expected a positive int")
        if not isinstance(toks, list) or len(toks) != bs * len(hashes) or \
                any(type(t) is not int or t < 0 for t in toks):
            raise ProtocolError(f"{what}.token_ids: expected {bs * len(hashes)} non-negative ints")
        return BlockStored(hashes, parent, tuple(toks), bs, None, _medium(w[6], what))
    if tag == "BlockRemoved":
        if len(w) < 3:
            raise ProtocolError(f"{what}: BlockRemoved has 2 fields, got {len(w) - 1}")
        return BlockRemoved(_hashes(w[1], f"{what}.block_hashes"), _medium(w[2], what))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ProtocolError(f"{what}: unknown event {tag[:40]!r}")


def decode_batch(data: bytes) -> KVEventBatch:
    """A KVEventBatch from peer bytes; ProtocolError naming the field that was wrong."""
    w = codec.unpack(data, what="kv event batch")
    if not isinstance(w, list) or len(w) < 2 or not isinstance(w[0], (int, float)) or isinstance(w[0], bool) \
            or not isinstance(w[1], list):
        raise ProtocolError("kv event batch: expected [ts, events, data_parallel_rank]")
    dp = w[2] if len(w) > 2 else None
    if dp is not None and type(dp) is not int:
        raise ProtocolError("kv event batch: data_parallel_rank must be an int or None")
    return KVEventBatch(float(w[0]), tuple(_event(e, i) for i, e in enumerate(w[1])), dp)


# --- signatures -------------------------------------------------------------------------------------------
def derive_secret(token: str) -> bytes:
    """The key of KV-event signatures, derived from the deployment's internal token (the token itself never
    goes on this wire)."""
    return hmac.new(token.encode(), b"kvbridge-kv-events/%d" % KV_EVENTS_VERSION, hashlib.sha256).digest()


def subscriber_password(secret: bytes) -> bytes:
    """What a subscriber presents (ZAP PLAIN) to the worker's PUB and replay sockets."""
    return hmac.new(secret, b"subscribe", hashlib.sha256).hexdigest().encode()


def sign(secret: bytes, *parts: bytes) -> bytes:
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.digest()


def make_topic(secret: bytes, incarnation: str, seq: int, payload: bytes) -> bytes:
    inc = incarnation.encode()
    return TOPIC_PREFIX + inc + b"|" + sign(secret, inc, seq.to_bytes(8, "big"), payload).hex().encode()


def parse_topic(secret: bytes, topic: bytes, seq_frame: bytes, payload: bytes) -> tuple[str, int]:
    """(incarnation, seq) of a signed batch; ProtocolError when it is malformed or its signature is wrong."""
    if not topic.startswith(TOPIC_PREFIX) or len(seq_frame) != 8:
        raise ProtocolError("kv event: not a kvbridge topic or a bad seq frame")
    inc, sep, mac = topic[len(TOPIC_PREFIX):].rpartition(b"|")
    if not sep or not inc or len(inc) > 200:
        raise ProtocolError("kv event: the topic names no incarnation")
    want = sign(secret, inc, seq_frame, payload).hex().encode()
    if not hmac.compare_digest(want, mac):
        raise ProtocolError("kv event: bad signature (not signed with this deployment's token)")
    return inc.decode("utf-8", "replace"), int.from_bytes(seq_frame, "big")


# --- determinism --------------------------------------------------------------------------------------------
def check_deterministic(fingerprint: str) -> None:
    """Refuse to publish hashes another process could compute differently.

    Raises:
        ExecutorError: the reference vector came out different, or the fingerprint holds something that is
            not the same in every process (an object address, an empty model id).
    """
    fp, toks, tpb, want = REFERENCE
    got = tuple(k.hex() for k in chain_keys(fp, toks, tpb))
    if got != want:
        raise ExecutorError(f"kv events: this process computes the reference block keys as {got}, not {want} "
                            f"({KEY_VERSION.decode()}); its hashes would not match other processes'")
    if not fingerprint or fingerprint.endswith(":") or " at 0x" in fingerprint:
        raise ExecutorError(f"kv events: the cache fingerprint {fingerprint!r} is not the same in every process "
                            f"(it needs the layout and a model id, and no object address)")


class KVEventLog:
    """The PrefixTree's listener on the leader rank: events pile up during a step, `take_batch` numbers them.

    Consecutive stores of one chain become one BlockStored (vLLM's grouping). Single-threaded: the leader's
    thread calls everything here.
    """

    def __init__(self, fingerprint: str, block_size: int, medium: str) -> None:
        self.root = root_key(fingerprint)
        self.block_size, self.medium = int(block_size), medium
        self.seq = 0
        self._pending: list[Event] = [AllBlocksCleared()]  # batch 1: a new incarnation starts empty

    def stored(self, key: bytes, parent: bytes, tokens: tuple[int, ...]) -> None:
        last = self._pending[-1] if self._pending else None
        if isinstance(last, BlockStored) and last.block_hashes[-1] == parent:
            self._pending[-1] = BlockStored(last.block_hashes + (key,), last.parent_block_hash,
                                            last.token_ids + tuple(tokens), self.block_size, None, self.medium)
            return
        self._pending.append(BlockStored((key,), None if parent == self.root else parent, tuple(tokens),
                                         self.block_size, None, self.medium))

    def removed(self, key: bytes) -> None:
        last = self._pending[-1] if self._pending else None
        if isinstance(last, BlockRemoved):
            self._pending[-1] = BlockRemoved(last.block_hashes + (key,), self.medium)
        else:
            self._pending.append(BlockRemoved((key,), self.medium))

    def cleared(self) -> None:
        """Everything went (a relayed source that restarted or dropped a batch): what is pending goes too."""
        self._pending = [AllBlocksCleared()]

    def take_batch(self) -> tuple[int, bytes] | None:
        """(seq, payload) of the events since the last call; None when there were none."""
        if not self._pending:
            return None
        self.seq += 1
        payload = encode_batch(KVEventBatch(time.time(), tuple(self._pending)))
        self._pending = []
        return self.seq, payload
