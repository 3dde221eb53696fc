"""A storage agent ("file"): READ/WRITE between registered host or GPU memory and objects in a folder.

The storage counterpart of a network agent, under the same TransferAgent contract, so other storage (an
object store, a distributed KV store) plugs in the same way. Its peer is a FILE SET, not a process: a
folder, a tag and an ordered list of object names, built with `file_set(root, names, tag)` (sealed msgpack,
like any agent's metadata) and learned with `connect`:

    peer = agent.connect(file_set("/data/kv/ns/r0", ["3fa1...", "77c0..."], tag=b"..."))
    remote = DescriptorList(object_addrs([0, 1]), lengths)    # object i at (i + 1) << OBJECT_SHIFT
    h = agent.write(peer, local, remote); h.wait(30); h.release(); agent.disconnect(peer)

Object i of a file set is the remote region starting at address `(i + 1) << OBJECT_SHIFT` (objects of up to
1 TiB, up to 2**23 - 1 objects per set); it lives in `<root>/<name[:2]>/<name>.kvb`.

Rules this agent keeps:
- An object is written and read WHOLE, as one or more consecutive descriptors tiling it from offset 0 (its
  payload is their bytes, in order): the object is the unit of atomicity and of checksumming.
- WRITE goes to a temporary file in the object's folder, is fsynced, then `os.replace`d onto the object's
  name: a reader in any process sees the old object or the new one, never part of one; of several writers
  of one name the last replace wins and every version is complete. A failed write leaves no file behind.
- READ is DONE only if the file's header is valid (magic, version, header size), names this object and
  this tag, the file holds exactly header + payload bytes, the payload has the length asked for, and the
  checksum (xxh3-128 over the header and the payload) verifies. Objects are read into a bounce buffer, in
  batches of up to STAGE_BYTES, and a batch is placed in local memory only after every object of it
  verified: a failed read leaves the local memory of its batch untouched. GPU memory moves through that
  buffer with one copy per batch each way.
- No code ever runs on load: a fixed binary header and raw bytes (never pickle, never torch.load).
- read/write return at once; the agent's I/O threads move the bytes. Never deletes objects (eviction is
  the store's policy, see kvbridge.executor.connector.store).

Object file format (little-endian), a 128-byte header then the payload:

    0 magic b"KVBF" | 4 version u16 | 6 header size u16 | 8 payload length u64 | 16 checksum (16 bytes)
    32 tag (32 bytes, zero padded) | 64 name (64 bytes ASCII, zero padded) | 128 payload
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import re
import secrets
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import xxhash

from ..errors import AgentError, PeerError
from .base import DescriptorList, MemoryKind, MemoryRegion, TransferAgent, TransferHandle
from .handles import FutureTransfer
from .envelope import field, open_envelope, seal
from .staging import gather, scatter

log = logging.getLogger(__name__)

__all__ = [
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAGIC",
    "OBJECT_SHIFT",
    "FileAgent",
    "ObjectHeader",
    "file_set",
    "object_addrs",
    "object_path",
    "read_header",
]

MAGIC = b"KVBF"
FORMAT_VERSION = 1
HEADER_SIZE = 128
OBJECT_SHIFT = 40
MAX_OBJECTS = (1 << (63 - OBJECT_SHIFT)) - 1
_HEAD = struct.Struct("<4sHHQ16s32s64s")
_NAME_RE = re.compile(r"^[0-9A-Za-z_.-]{1,64}$")
_OFF_MASK = (1 << OBJECT_SHIFT) - 1
STAGE_BYTES = 64 << 20  # objects are read (and GPU memory staged) in batches of at most this many bytes


def object_addrs(indices) -> np.ndarray:
    """Remote start addresses of objects `indices` of a file set (int64 array)."""
    idx = np.asarray(indices, dtype=np.int64)
    return (idx + 1) << OBJECT_SHIFT


def object_path(root: str, name: str) -> str:
    """Where object `name` of a file set rooted at `root` lives."""
    return os.path.join(root, name[:2], name + ".kvb")


def file_set(root: str, names: list[str], tag: bytes = b"") -> bytes:
    """The metadata blob of a file set (what `FileAgent.connect` takes).

    Args:
        root: the folder holding the objects (created on the first write).
        names: object names (1-64 of [0-9A-Za-z_.-], unique); object i is at `object_addrs([i])`.
        tag: up to 32 bytes written into every header and checked on read (e.g. a layout digest and rank).
    """
    return seal(FileAgent.agent_kind, "fileset", {"role": "fileset", "root": str(root), "tag": bytes(tag),
                                                  "names": list(names)})


@dataclass(frozen=True)
class ObjectHeader:
    """A parsed object header (see the module docstring for the layout)."""

    payload_len: int
    checksum: bytes
    tag: bytes          # the 32-byte field, zero padded
    name: str
    file_size: int

    @property
    def complete(self) -> bool:
        """The file holds exactly the header and the payload it announces (not truncated, nothing extra)."""
        return self.file_size == HEADER_SIZE + self.payload_len


def _pack_header(payload_len: int, checksum: bytes, tag: bytes, name: str) -> bytes:
    return _HEAD.pack(MAGIC, FORMAT_VERSION, HEADER_SIZE, payload_len, checksum, tag, name.encode("ascii"))


def _parse_header(raw: bytes, file_size: int) -> ObjectHeader | str:
    if len(raw) < HEADER_SIZE:
        return f"{len(raw)} bytes, shorter than the {HEADER_SIZE}-byte header"
    magic, ver, hsize, plen, csum, tag, name = _HEAD.unpack(raw[:HEADER_SIZE])
    if magic != MAGIC:
        return f"bad magic {magic!r} (not a kvbridge object file)"
    if ver != FORMAT_VERSION or hsize != HEADER_SIZE:
        return (f"format version {ver} / header size {hsize}, this agent reads {FORMAT_VERSION} / "
                f"{HEADER_SIZE}")
    try:
        text = name.rstrip(b"\0").decode("ascii")
    except UnicodeDecodeError:
        return "object name in the header is not ASCII"
    return ObjectHeader(int(plen), bytes(csum), bytes(tag), text, int(file_size))


def read_header(path: str) -> ObjectHeader | str:
    """The header of the object file at `path`, or a string saying why it cannot be used (missing, short,
    foreign, another version). Cheap: reads 128 bytes. Does not verify the payload checksum."""
    try:
        with open(path, "rb", buffering=0) as f:
            raw = f.read(HEADER_SIZE)
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        return "no such object"
    except OSError as e:
        return f"cannot be read ({e})"
    return _parse_header(raw, size)


@dataclass
class _FileSet:
    root: str
    tag: bytes
    names: list[str]


class FileAgent(TransferAgent):
    """Moves registered memory to and from object files (see the module docstring).

    Args:
        name: the agent's name (used in temporary file names and logs).
        io_threads: transfers running at once (each transfer's objects go one after another).
        fsync: fsync each object before it is renamed into place (durable across a crash of the host).
    """

    agent_kind = "file"
    memory_kinds = frozenset({MemoryKind.DRAM, MemoryKind.VRAM})

    def __init__(self, name: str, io_threads: int = 2, fsync: bool = True) -> None:
        super().__init__(name)
        self._sets: dict[str, _FileSet] = {}
        self._lock = threading.Lock()  # guards _sets
        self._ids = itertools.count(1)
        self._fsync = bool(fsync)
        self._pool = ThreadPoolExecutor(max_workers=max(1, int(io_threads)),
                                        thread_name_prefix=f"file-{name}")

    # --- contract hooks ------------------------------------------------------------------------------
    def _register(self, region: MemoryRegion, key: int) -> None:
        if region.kind is MemoryKind.VRAM:
            import torch

            if not torch.cuda.is_available():
                raise AgentError("file agent: VRAM registration needs CUDA, and torch sees no GPU")

    def _unregister(self, region: MemoryRegion, key: int) -> None:
        pass

    def _metadata(self) -> bytes:
        return seal(self.agent_kind, self.name, {"role": "client"})

    def _connect(self, peer_metadata: bytes) -> str:
        _, p = open_envelope(peer_metadata, self.agent_kind)
        if p.get("role") != "fileset":
            raise PeerError("file agent: connect takes a file set (kvbridge.agents.file_agent.file_set), not "
                            "another file agent's metadata")
        root = field(p, "root", str, "file set")
        tag = field(p, "tag", bytes, "file set")
        names = field(p, "names", list, "file set")
        if not root:
            raise PeerError("file set: empty root folder")
        if len(tag) > 32:
            raise PeerError(f"file set: tag of {len(tag)} bytes, at most 32")
        if len(names) > MAX_OBJECTS:
            raise PeerError(f"file set: {len(names)} objects, at most {MAX_OBJECTS}")
        bad = next((n for n in names if not isinstance(n, str) or not _NAME_RE.match(n)), None)
        if bad is not None:
            raise PeerError(f"file set: object name {bad!r:.80} is not 1-64 characters of [0-9A-Za-z_.-]")
        if len(set(names)) != len(names):
            raise PeerError("file set: object names repeat")
        peer = f"fileset-{next(self._ids)}"
        with self._lock:
            self._sets[peer] = _FileSet(root, tag, names)
        return peer

    def _disconnect(self, peer: str) -> None:
        with self._lock:
            self._sets.pop(peer, None)

    def _close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _post(self, op: str, peer: str, local: DescriptorList, remote: DescriptorList) -> TransferHandle:
        fs = self._sets[peer]
        objs = self._objects(fs, remote)
        cancel = threading.Event()
        fn = self._write_objects if op == "WRITE" else self._read_objects
        fut = self._pool.submit(fn, fs, objs, local, cancel)
        return FutureTransfer(fut, len(local), local.nbytes, on_cancel=cancel.set)

    # --- descriptors -> objects ----------------------------------------------------------------------
    @staticmethod
    def _objects(fs: _FileSet, remote: DescriptorList) -> list[tuple[int, int, int]]:
        """(object index, first descriptor, end descriptor) per object; AgentError unless each object is
        tiled from offset 0 by one run of consecutive descriptors."""
        n = len(remote)
        if n == 0:
            return []
        obj = (remote.addrs >> OBJECT_SHIFT) - 1
        off = remote.addrs & _OFF_MASK
        if obj.min() < 0 or obj.max() >= len(fs.names):
            bad = int(np.argmax((obj < 0) | (obj >= len(fs.names))))
            raise AgentError(f"file set: remote descriptor {bad} (address {int(remote.addrs[bad]):#x}) names "
                             f"no object of the set's {len(fs.names)}")
        if int((off + remote.lengths).max()) > _OFF_MASK:
            raise AgentError("file set: a remote descriptor runs past its object's 1 TiB window")
        starts = np.ones(n, dtype=bool)
        starts[1:] = obj[1:] != obj[:-1]
        ok = np.where(starts, off == 0, True)
        ok[1:] &= starts[1:] | (off[1:] == off[:-1] + remote.lengths[:-1])
        if not ok.all():
            bad = int(np.argmin(ok))
            raise AgentError(f"file set: remote descriptor {bad} (object {int(obj[bad])}, offset "
                             f"{int(off[bad])}) does not continue its object: objects are moved whole, by "
                             f"consecutive descriptors from offset 0")
        first = np.flatnonzero(starts)
        if np.unique(obj[first]).shape[0] != first.shape[0]:
            raise AgentError("file set: an object appears in two separate runs of descriptors")
        ends = np.append(first[1:], n)
        return [(int(obj[a]), int(a), int(b)) for a, b in zip(first, ends)]

    # --- the I/O threads -----------------------------------------------------------------------------
    @staticmethod
    def _batches(objs, local: DescriptorList) -> list[list[tuple[int, int, int]]]:
        """Consecutive objects in groups of at most STAGE_BYTES (one object at least per group)."""
        out, cur, size = [], [], 0
        for o in objs:
            n = int(local.lengths[o[1]:o[2]].sum())
            if cur and size + n > STAGE_BYTES:
                out.append(cur)
                cur, size = [], 0
            cur.append(o)
            size += n
        return out + ([cur] if cur else [])

    def _write_objects(self, fs: _FileSet, objs, local: DescriptorList, cancel: threading.Event) -> None:
        for batch in self._batches(objs, local):
            if cancel.is_set():
                raise AgentError("cancelled")
            if local.kind is MemoryKind.DRAM:  # straight from the registered memory
                for i, a, b in batch:
                    self._write_one(fs, fs.names[i], [_host_bytes(int(local.addrs[j]), int(local.lengths[j]))
                                                      for j in range(a, b)])
                continue
            import torch

            a0, b0 = batch[0][1], batch[-1][2]
            dev = torch.empty(int(local.lengths[a0:b0].sum()), dtype=torch.uint8,
                              device=f"cuda:{local.device}")
            gather(local.kind, local.device, local.addrs[a0:b0], local.lengths[a0:b0], dev)
            host = memoryview(dev.cpu().numpy()).cast("B")  # one device-to-host copy for the whole batch
            off = 0
            for i, a, b in batch:
                n = int(local.lengths[a:b].sum())
                self._write_one(fs, fs.names[i], [host[off:off + n]])
                off += n

    def _read_objects(self, fs: _FileSet, objs, local: DescriptorList, cancel: threading.Event) -> None:
        for batch in self._batches(objs, local):
            a0, b0 = batch[0][1], batch[-1][2]
            buf = bytearray(int(local.lengths[a0:b0].sum()))
            view, off = memoryview(buf), 0
            for i, a, b in batch:  # every object of the batch is read and verified before any byte is placed
                if cancel.is_set():
                    raise AgentError("cancelled")
                n = int(local.lengths[a:b].sum())
                self._read_one(fs, fs.names[i], view[off:off + n])
                off += n
            if local.kind is MemoryKind.DRAM:
                off = 0
                for j in range(a0, b0):
                    n = int(local.lengths[j])
                    ctypes.memmove(int(local.addrs[j]), (ctypes.c_char * n).from_buffer(buf, off), n)
                    off += n
                continue
            import torch

            dev = torch.frombuffer(buf, dtype=torch.uint8).to(f"cuda:{local.device}")  # one copy to the GPU
            scatter(local.kind, local.device, local.addrs[a0:b0], local.lengths[a0:b0], dev)
            torch.cuda.synchronize(dev.device)  # in place before the transfer reports DONE

    def _write_one(self, fs: _FileSet, name: str, parts: list[memoryview]) -> None:
        path = object_path(fs.root, name)
        size = sum(p.nbytes for p in parts)
        h = xxhash.xxh3_128()
        h.update(_pack_header(size, bytes(16), fs.tag, name))
        for p in parts:
            h.update(p)
        header = _pack_header(size, h.digest(), fs.tag, name)
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        tmp = f"{path}.tmp.{os.getpid()}.{secrets.token_hex(6)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                _write_all(fd, memoryview(header))
                for p in parts:
                    _write_all(fd, p)
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def _read_one(self, fs: _FileSet, name: str, view: memoryview) -> None:
        """Read and verify object `name` into `view` (exactly its payload length)."""
        want = view.nbytes
        path = object_path(fs.root, name)
        try:
            f = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by the `with f` below
        except FileNotFoundError:
            raise AgentError(f"object {name} is not in {fs.root}") from None
        with f:
            size = os.fstat(f.fileno()).st_size
            hdr = _parse_header(_read_exact(f, HEADER_SIZE), size)
            if isinstance(hdr, str):
                raise AgentError(f"object {path}: {hdr}")
            if hdr.name != name or hdr.tag != fs.tag.ljust(32, b"\0"):
                got = hdr.tag.rstrip(b"\0").hex()
                raise AgentError(f"object {path}: its header names {hdr.name!r} / tag {got}, expected "
                                 f"{name!r} / tag {fs.tag.hex()} (a misplaced or foreign file)")
            if not hdr.complete:
                raise AgentError(f"object {path}: file holds {size} bytes, its header announces "
                                 f"{HEADER_SIZE + hdr.payload_len} (truncated or extended)")
            if hdr.payload_len != want:
                raise AgentError(f"object {path}: payload of {hdr.payload_len} bytes, the read asked for "
                                 f"{want}")
            got = 0
            while got < want:
                k = f.readinto(view[got:])
                if not k:
                    raise AgentError(f"object {path}: file ended after {HEADER_SIZE + got} bytes")
                got += k
        h = xxhash.xxh3_128()
        h.update(_pack_header(hdr.payload_len, bytes(16), hdr.tag, hdr.name))
        h.update(view)
        if h.digest() != hdr.checksum:
            raise AgentError(f"object {path}: checksum mismatch (the file is corrupt)")


def _host_bytes(addr: int, n: int) -> memoryview:
    return memoryview((ctypes.c_uint8 * n).from_address(addr)).cast("B")


def _write_all(fd: int, data: memoryview) -> None:
    while data.nbytes:
        k = os.write(fd, data)
        data = data[k:]


def _read_exact(f, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = f.read(n - len(out))
        if not chunk:
            break
        out += chunk
    return out
