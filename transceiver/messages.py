"""Wire messages of the control plane: frozen dataclasses <-> msgpack maps, versioned, strictly validated.

Every frame is one msgpack map {"v": PROTOCOL_VERSION, "t": <type name>, ...fields}. `decode` checks the
frame size, the version, the type, every field's presence and type, and raises ProtocolError naming what was
wrong; it never executes anything from the frame. Block ids travel as little-endian int64 bytes (one `bin`
field), never as per-block objects.

Conversation (generation rank G pulls a request from context rank C):

    G -> C  Hello(gen_instance, gen_rank, gen_layout, agents)         once per peer pair
    C -> G  Welcome(ctx_instance, ctx_rank, ctx_layout, agents, pool_bases, num_blocks, lease_s)
    G -> C  Fetch(ctx_request_id, gen_rank, stream, staged, from_token, secret)  per request (from_token > 0:
                                                                      the generation side holds the prefix and
                                                                      reads only tokens [from_token, n)); a
                                                                      wrong or missing secret is answered
                                                                      exactly like an unknown id
            Fetch(..., read_ahead=True, block_ids)                    read-ahead: G took the block ids from its
                                                                      DisaggParams and posted its reads with
                                                                      this Fetch; C answers no Blocks, only an
                                                                      Error(read_ahead) when it cannot vouch
                                                                      for them (then the pull fails)
            Fetch(..., read_ahead=True, block_ids, done=True)         ...and those reads had all finished when
                                                                      it was sent: the Fetch is also the
                                                                      reader's Done(ok); C answers DoneAck
    C -> G  Blocks(ctx_request_id, block_ids, num_tokens, layers_ready, lease_s, staging_addr, staging_bytes)
            (staged: the context rank packed the piece into a slot of its arena; one read moves it; with
            layers not all ready, layers_ready counts the layers packed and each LayersReady follows a pack)
    C -> G  LayersReady(ctx_request_id, layers_ready)                 streaming: pushed as layers finish
    G -> C  Heartbeat(ctx_request_ids)                                renews leases while reading
    C -> G  HeartbeatAck(ctx_request_ids, alive)
    G -> C  Done(ctx_request_id, gen_rank, ok, error, digests)        after the READs finished (or failed)
    C -> G  DoneAck(ctx_request_id, valid, intact)                    valid: blocks were still pinned;
                                                                      intact: digests matched (verify mode)
    C -> G  Error(code, message, ctx_request_id, reply_to)            any request that cannot be served

A generation rank counts its KV as received only after DoneAck(valid=True): the context side confirms that
the blocks were still pinned (lease not expired, not evicted) when the read finished.

One ZeroMQ message may carry up to MAX_BATCH of these frames as its parts (outbox.py: what one I/O loop turn
sends one peer); each part is decoded and answered on its own.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from ..codec import pack, unpack
from ..errors import (KvBridgeError, LayoutMismatchError, LeaseExpired, ProtocolError, ReadAheadRefused,
                      RequestCancelled, RequestNotFound)
from ..formatter.mapping import MAPPING_VERSION

PROTOCOL_VERSION = 5  # bump when a message changes shape or meaning (2: Fetch carries the request's secret;
#                        3: read-ahead; 4: a read-ahead Fetch may carry its Done: an older peer would ignore it;
#                        5: a staged Blocks may come before every layer is packed: layers_ready counts the
#                        layers packed, LayersReady follows each pack; Welcome.staging_kind). Not bumped: a
#                        failed reader's Done(ok=False) may now withdraw a Fetch still waiting for the publish
#                        (an older context rank answers it as about an unknown request, as before)
MAX_FRAME_BYTES = 16 << 20  # 2M block ids fit; a larger frame is refused before decoding
MAX_BLOCK_IDS = 1 << 21
MAX_BATCH = 256  # wire messages one ZeroMQ message may carry (its parts); a longer one is refused whole


class ErrorCode(str, enum.Enum):
    MALFORMED = "malformed"          # undecodable frame / bad field
    VERSION = "version"              # protocol version mismatch
    NO_SESSION = "no_session"        # Fetch/Done before Hello on this connection
    LAYOUT_MISMATCH = "layout_mismatch"
    UNKNOWN_REQUEST = "unknown_request"
    LEASE_EXPIRED = "lease_expired"
    CANCELLED = "cancelled"
    TAKEN = "taken"                  # another generation instance is already pulling this request
    AGENT = "agent"                  # no common transfer agent
    BUSY = "busy"                    # too many sessions on this context rank (transceiver.max_sessions)
    READ_AHEAD = "read_ahead"        # a read-ahead Fetch this context rank cannot vouch for
    INTERNAL = "internal"


# What an Error frame's code means to the generation side: the KvBridgeError a failed pull reports.
ERROR_TYPES: dict[str, type[KvBridgeError]] = {
    ErrorCode.UNKNOWN_REQUEST.value: RequestNotFound, ErrorCode.LEASE_EXPIRED.value: LeaseExpired,
    ErrorCode.LAYOUT_MISMATCH.value: LayoutMismatchError, ErrorCode.VERSION.value: ProtocolError,
    ErrorCode.MALFORMED.value: ProtocolError, ErrorCode.CANCELLED.value: RequestCancelled,
    ErrorCode.READ_AHEAD.value: ReadAheadRefused,
}


def _blocks_to_bytes(ids) -> bytes:
    return np.ascontiguousarray(ids, dtype="<i8").tobytes()


def _blocks_from_bytes(b: bytes, what: str) -> np.ndarray:
    if len(b) % 8:
        raise ProtocolError(f"{what}: block_ids is {len(b)} bytes, not a multiple of 8")
    if len(b) // 8 > MAX_BLOCK_IDS:
        raise ProtocolError(f"{what}: {len(b) // 8} block ids exceeds the limit of {MAX_BLOCK_IDS}")
    return np.frombuffer(b, dtype="<i8").astype(np.int64)


# field kinds: python type to check on decode (bool is not an int here)
_SCALARS = {int: int, str: str, bool: bool, float: (float, int), bytes: bytes, dict: dict, list: list}


@dataclass(frozen=True, slots=True)
class Message:
    TYPE: ClassVar[str] = ""

    def encode(self) -> bytes:
        d: dict[str, Any] = {"v": PROTOCOL_VERSION, "t": self.TYPE}
        for f in _spec(type(self)):
            v = getattr(self, f.name)
            if f.blocks:
                v = _blocks_to_bytes(v)
            elif isinstance(v, enum.Enum):
                v = v.value
            elif isinstance(v, tuple):
                v = list(v)
            d[f.name] = v
        return pack(d)


@dataclass(frozen=True, slots=True)
class _Field:
    """What encode and decode need to know of one message field, worked out once per class (`_spec`)."""

    name: str
    kind: Any  # the declared kind (int, str, ...), named in errors
    want: Any  # what isinstance checks on decode
    required: bool
    blocks: bool
    bound: int  # ints must lie in [-bound, bound)
    as_tuple: bool  # the default is a tuple: a decoded list becomes one


_SPECS: dict[type, tuple[_Field, ...]] = {}


def _spec(cls: type) -> tuple[_Field, ...]:
    """The fields of message class `cls` (cached: dataclasses.fields and metadata lookups cost per message)."""
    spec = _SPECS.get(cls)
    if spec is None:
        spec = tuple(_Field(f.name, _kind(f), _SCALARS[_kind(f)], f.default is dataclasses.MISSING,
                            bool(f.metadata.get("blocks")), 1 << 63 if f.metadata.get("wide") else 1 << 62,
                            isinstance(f.default, tuple)) for f in dataclasses.fields(cls))
        _SPECS[cls] = spec
    return spec


def _kind(f: dataclasses.Field) -> Any:
    return f.metadata.get("kind", f.type)


def msg(kind: Any = None, **meta) -> Any:
    """Field declaration helper: msg(int), msg(bytes, blocks=True), msg(str, default="")."""
    default = meta.pop("default", dataclasses.MISSING)
    compare = meta.pop("compare", True)  # False for an array field: == of two messages skips it
    md = {"kind": kind, **meta}
    if default is dataclasses.MISSING:
        return field(metadata=md, compare=compare)
    return field(default=default, metadata=md, compare=compare)


@dataclass(frozen=True, slots=True)
class Hello(Message):
    TYPE: ClassVar[str] = "hello"
    gen_instance: str = msg(str)
    gen_rank: int = msg(int)
    gen_layout: dict = msg(dict)
    agents: list = msg(list)  # agent kinds the generation rank can use, in preference order
    host: str = msg(str, default="")
    mapping_version: int = msg(int, default=MAPPING_VERSION)


@dataclass(frozen=True, slots=True)
class Welcome(Message):
    TYPE: ClassVar[str] = "welcome"
    ctx_instance: str = msg(str)
    ctx_rank: int = msg(int)
    ctx_layout: dict = msg(dict)
    agents: dict = msg(dict)  # agent kind -> metadata bytes
    pool_bases: list = msg(list)
    num_blocks: int = msg(int)
    pool_kind: str = msg(str)  # "DRAM" | "VRAM"
    pool_device: int = msg(int)
    lease_s: float = msg(float)
    host: str = msg(str, default="")
    staging_base: int = msg(int, default=0)  # the context rank's staging arena (0 bytes: no staged path)
    staging_bytes: int = msg(int, default=0)
    staging_kind: str = msg(str, default="")  # where the arena lives ("DRAM" | "VRAM"; "": the pool's kind)


@dataclass(frozen=True, slots=True)
class Fetch(Message):
    TYPE: ClassVar[str] = "fetch"
    ctx_request_id: int = msg(int, wide=True)
    gen_rank: int = msg(int)
    stream: bool = msg(bool, default=False)
    staged: bool = msg(bool, default=False)  # ask the context rank to pack the piece into its arena
    from_token: int = msg(int, default=0)  # prefix reuse: read only tokens [from_token, num_tokens); 0 = all
    secret: bytes = msg(bytes, default=b"")  # the request's secret (DisaggParams.secret)
    read_ahead: bool = msg(bool, default=False)  # reads already posted from `block_ids`: answer no Blocks
    block_ids: Any = msg(bytes, blocks=True, default=(), compare=False)  # read-ahead: the ids G reads from
    done: bool = msg(bool, default=False)  # read-ahead only: those reads all finished; this is also Done(ok)

    def __repr__(self) -> str:  # never log the secret
        return f"Fetch(ctx_request_id={self.ctx_request_id}, gen_rank={self.gen_rank}, stream={self.stream}, " \
               f"staged={self.staged}, from_token={self.from_token}, read_ahead={self.read_ahead}, " \
               f"done={self.done}, secret=<{len(self.secret)} bytes>)"


@dataclass(frozen=True, slots=True)
class Blocks(Message):
    TYPE: ClassVar[str] = "blocks"
    ctx_request_id: int = msg(int, wide=True)
    block_ids: Any = msg(bytes, blocks=True)
    num_tokens: int = msg(int)
    layers_ready: int = msg(int)  # layers of this context rank readable now (== its local layers when done)
    lease_s: float = msg(float)
    staging_addr: int = msg(int, default=-1)  # staged: the packed piece's slot (-1: read direct)
    staging_bytes: int = msg(int, default=0)


@dataclass(frozen=True, slots=True)
class LayersReady(Message):
    TYPE: ClassVar[str] = "layers_ready"
    ctx_request_id: int = msg(int, wide=True)
    layers_ready: int = msg(int)


@dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    TYPE: ClassVar[str] = "heartbeat"
    ctx_request_ids: list = msg(list)


@dataclass(frozen=True, slots=True)
class HeartbeatAck(Message):
    TYPE: ClassVar[str] = "heartbeat_ack"
    ctx_request_ids: list = msg(list)
    alive: list = msg(list)  # bool per id: still pinned for this reader


@dataclass(frozen=True, slots=True)
class Done(Message):
    TYPE: ClassVar[str] = "done"
    ctx_request_id: int = msg(int, wide=True)
    gen_rank: int = msg(int)
    ok: bool = msg(bool)
    error: str = msg(str, default="")
    digests: list = msg(list, default=())  # verification mode: xxh3-64 per layer read from this context rank


@dataclass(frozen=True, slots=True)
class DoneAck(Message):
    TYPE: ClassVar[str] = "done_ack"
    ctx_request_id: int = msg(int, wide=True)
    valid: bool = msg(bool)
    reason: str = msg(str, default="")
    intact: bool = msg(bool, default=True)  # verification mode: digests matched


@dataclass(frozen=True, slots=True)
class Error(Message):
    TYPE: ClassVar[str] = "error"
    code: str = msg(str)
    message: str = msg(str)
    ctx_request_id: int = msg(int, default=-1, wide=True)
    reply_to: str = msg(str, default="")


MESSAGE_TYPES: dict[str, type[Message]] = {
    c.TYPE: c for c in (Hello, Welcome, Fetch, Blocks, LayersReady, Heartbeat, HeartbeatAck, Done, DoneAck, Error)
}


def decode(frame: bytes) -> Message:
    """Decode and validate one frame; ProtocolError naming the problem (size, version, type, field)."""
    d = unpack(frame, max_bytes=MAX_FRAME_BYTES, what="control frame")
    if not isinstance(d, dict):
        raise ProtocolError("control frame: expected a map")
    v = d.get("v")
    if type(v) is not int or v != PROTOCOL_VERSION:  # true and 1.0 compare equal to 1: not a version
        raise ProtocolError(f"control frame: protocol version {v!r}, this side speaks {PROTOCOL_VERSION}")
    t = d.get("t")
    cls = MESSAGE_TYPES.get(t) if isinstance(t, str) else None
    if cls is None:
        raise ProtocolError(f"control frame: unknown message type {t!r}")
    what = f"{t} message"
    kwargs: dict[str, Any] = {}
    for f in _spec(cls):
        if f.name not in d:
            if not f.required:
                continue
            raise ProtocolError(f"{what}: missing field {f.name!r}")
        val = d[f.name]
        want = f.want
        if not isinstance(val, want) or (want is int and isinstance(val, bool)):
            raise ProtocolError(f"{what}: field {f.name!r} should be {f.kind.__name__}, got {type(val).__name__}")
        # request handles use all 63 bits (bound 2**63 for "wide" fields)
        if isinstance(val, int) and not isinstance(val, bool) and not -f.bound <= val < f.bound:
            raise ProtocolError(f"{what}: field {f.name!r} is out of range")
        if f.blocks:
            val = _blocks_from_bytes(val, what)
        elif want == (float, int):
            val = float(val)
        elif f.as_tuple:
            val = tuple(val)
        kwargs[f.name] = val
    # Unknown fields are ignored (not an error): within one protocol version, fields are only ever added
    # with defaults, so an older peer keeps working. The frame size bound caps what they can cost.
    return cls(**kwargs)


def int_list(val: list, what: str, limit: int = MAX_BLOCK_IDS) -> list[int]:
    """Validate a list of ints from a message (e.g. heartbeat ids, pool bases)."""
    if len(val) > limit or not all(isinstance(x, int) and not isinstance(x, bool) for x in val):
        raise ProtocolError(f"{what}: expected a list of at most {limit} integers")
    return val
