"""The wire format a ConnectionAgent speaks over a Connection: fixed little-endian structs and int64 arrays.

Owns encoding and validating the frames of the READ/WRITE protocol (see conn_agent.py for the exchange).
Every frame from a peer is checked here (magic, version, op, memory kind, counts against limits) and a bad
one raises ProtocolError naming the field. Nothing here is pickled or evaluated; descriptors travel as the
raw bytes of two int64 arrays.

    proof    = on every new connection, before any request: the server sends CHALLENGE (magic, version, 32
               random bytes), the requester answers PROOF_SIZE bytes, HMAC-SHA256 of the challenge under the
               server agent's connection key (32 random bytes in its metadata, which only the peers it was
               handed to know); a wrong or late answer closes the connection before any request is read
    request  = REQUEST header, then one message of 16 * ndesc bytes: ndesc addrs, ndesc lengths (int64 LE)
    response = RESPONSE header, then (status ERROR only) one message of `detail` bytes of UTF-8 text
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from dataclasses import dataclass

import numpy as np

from ..errors import ProtocolError
from .base import DescriptorList, MemoryKind

__all__ = ["Request", "Response", "READ", "WRITE", "OK", "DONE", "ERROR", "MAX_DESCRIPTORS",
           "MAX_ERROR_BYTES", "encode_descriptors", "decode_descriptors", "KEY_BYTES", "CHALLENGE_SIZE",
           "PROOF_SIZE", "challenge", "answer", "proven", "prove"]

MAGIC = b"KVBC"
VERSION = 2  # 2: the connection proof
READ, WRITE = 1, 2
# OK: data follows (READ) or send it (WRITE); DONE: the WRITE landed; ERROR: text follows
OK, DONE, ERROR = 0, 1, 2
MAX_DESCRIPTORS = 1 << 22  # 64 MiB of descriptors in one request
MAX_TRANSFER_BYTES = 1 << 40  # with MAX_DESCRIPTORS, sums of lengths cannot overflow int64
MAX_ERROR_BYTES = 4096
_KINDS = {0: MemoryKind.DRAM, 1: MemoryKind.VRAM}
_KIND_CODES = {v: k for k, v in _KINDS.items()}
_OPS = {READ: "READ", WRITE: "WRITE"}

_REQ = struct.Struct("<4sHBBIQQQ")   # magic, version, op, kind, device, req_id, ndesc, nbytes
_CHALLENGE = struct.Struct("<4sH32s")  # magic, version, nonce
KEY_BYTES = 32
CHALLENGE_SIZE, PROOF_SIZE = _CHALLENGE.size, hashlib.sha256().digest_size
_PROOF_LABEL = b"kvbridge connection proof v2\0"
_RESP = struct.Struct("<4sHBBIQ")    # magic, version, status, 0, detail (error text bytes), req_id


def _as_array(raw: bytes) -> np.ndarray:
    return np.frombuffer(bytearray(raw), dtype=np.uint8)


def _check_head(buf, st: struct.Struct, what: str) -> tuple:
    raw = bytes(buf)
    if len(raw) != st.size:
        raise ProtocolError(f"{what}: {len(raw)} bytes, expected {st.size}")
    fields = st.unpack(raw)
    if fields[0] != MAGIC:
        raise ProtocolError(f"{what}: bad magic {fields[0]!r} (not a kvbridge connection peer?)")
    if fields[1] != VERSION:
        raise ProtocolError(f"{what}: version {fields[1]}, this side speaks {VERSION}")
    return fields


@dataclass(frozen=True, slots=True)
class Request:
    """A READ or WRITE of `ndesc` ranges (`nbytes` in all) of the serving side's memory of kind/device."""

    op: int
    kind: MemoryKind
    device: int
    req_id: int
    ndesc: int
    nbytes: int

    SIZE = _REQ.size

    @property
    def op_name(self) -> str:
        return _OPS.get(self.op, str(self.op))

    def encode(self) -> np.ndarray:
        return _as_array(_REQ.pack(MAGIC, VERSION, self.op, _KIND_CODES[self.kind], self.device, self.req_id,
                                   self.ndesc, self.nbytes))

    @classmethod
    def decode(cls, buf) -> "Request":
        _, _, op, kind, device, req_id, ndesc, nbytes = _check_head(buf, _REQ, "request header")
        if op not in _OPS:
            raise ProtocolError(f"request header: unknown op {op}")
        if kind not in _KINDS:
            raise ProtocolError(f"request header: unknown memory kind code {kind}")
        if ndesc == 0:
            raise ProtocolError("request header: a request must carry at least one descriptor")
        if ndesc > MAX_DESCRIPTORS:
            raise ProtocolError(f"request header: {ndesc} descriptors exceeds the limit of {MAX_DESCRIPTORS}")
        if nbytes > MAX_TRANSFER_BYTES:
            raise ProtocolError(f"request header: {nbytes} bytes exceeds the limit of {MAX_TRANSFER_BYTES}")
        return cls(op, _KINDS[kind], device, req_id, ndesc, nbytes)


@dataclass(frozen=True, slots=True)
class Response:
    """The serving side's answer to request `req_id`; `detail` is the length of the error text (ERROR)."""

    status: int
    req_id: int
    detail: int = 0

    SIZE = _RESP.size

    def encode(self) -> np.ndarray:
        return _as_array(_RESP.pack(MAGIC, VERSION, self.status, 0, self.detail, self.req_id))

    @classmethod
    def decode(cls, buf, expect_id: int) -> "Response":
        _, _, status, _, detail, req_id = _check_head(buf, _RESP, "response header")
        if status not in (OK, DONE, ERROR):
            raise ProtocolError(f"response header: unknown status {status}")
        if req_id != expect_id:
            raise ProtocolError(f"response header: answers request {req_id}, expected {expect_id}")
        if detail > MAX_ERROR_BYTES:
            raise ProtocolError(f"response header: error text of {detail} bytes exceeds {MAX_ERROR_BYTES}")
        return cls(status, req_id, detail)


def encode_descriptors(descs: DescriptorList) -> np.ndarray:
    """The descriptor message: addrs then lengths as int64 little-endian, viewed as uint8."""
    out = np.empty(2 * len(descs), dtype="<i8")
    out[:len(descs)] = descs.addrs
    out[len(descs):] = descs.lengths
    return out.view(np.uint8)


def decode_descriptors(buf: np.ndarray, req: Request) -> DescriptorList:
    """Descriptors of `req` from its descriptor message; ProtocolError if they disagree with the header."""
    words = np.frombuffer(buf, dtype="<i8")
    if words.shape[0] != 2 * req.ndesc:
        raise ProtocolError(f"descriptor message: {buf.nbytes} bytes for {req.ndesc} descriptors")
    addrs = words[:req.ndesc].astype(np.int64)
    lengths = words[req.ndesc:].astype(np.int64)
    if req.ndesc and (lengths.min() <= 0 or addrs.min() <= 0):
        bad = int(np.argmax((lengths <= 0) | (addrs <= 0)))
        raise ProtocolError(f"descriptor {bad}: address {addrs[bad]} / length {lengths[bad]} not positive")
    if req.ndesc and int(lengths.max()) > MAX_TRANSFER_BYTES:
        bad = int(np.argmax(lengths))
        raise ProtocolError(f"descriptor {bad}: length {int(lengths[bad])} exceeds the limit")
    if int(lengths.sum()) != req.nbytes:
        raise ProtocolError(f"descriptors add up to {int(lengths.sum())} bytes, the header says {req.nbytes}")
    if req.ndesc and int((addrs.astype(np.uint64) + lengths.astype(np.uint64)).max()) >= 1 << 63:
        raise ProtocolError("a descriptor runs past the end of the address space")
    return DescriptorList(addrs, lengths, req.kind, req.device)


def encode_error(text: str) -> np.ndarray:
    return _as_array(text.encode("utf-8", "replace")[:MAX_ERROR_BYTES])


def decode_error(buf: np.ndarray) -> str:
    return bytes(buf).decode("utf-8", "replace")


def challenge() -> np.ndarray:
    """A fresh CHALLENGE frame (the server's first bytes on a new connection)."""
    return _as_array(_CHALLENGE.pack(MAGIC, VERSION, os.urandom(32)))


def answer(key: bytes, frame) -> np.ndarray:
    """The requester's PROOF for a CHALLENGE frame from the server whose connection key is `key`."""
    _check_head(frame, _CHALLENGE, "connection challenge")
    return _as_array(hmac.new(key, _PROOF_LABEL + bytes(frame), hashlib.sha256).digest())


def prove(conn, key: bytes, deadline: float) -> None:
    """The requester's side of the proof on a new Connection `conn`: read the server's CHALLENGE, send the
    answer under `key` (the server agent's connection key)."""
    frame = np.empty(CHALLENGE_SIZE, dtype=np.uint8)
    conn.recv(frame, deadline)
    conn.send(answer(key, frame), deadline)


def proven(key: bytes, frame, proof) -> bool:
    """Whether `proof` answers the CHALLENGE `frame` under `key` (compared in constant time)."""
    want = hmac.new(key, _PROOF_LABEL + bytes(frame), hashlib.sha256).digest()
    return hmac.compare_digest(bytes(proof), want)
