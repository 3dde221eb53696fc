"""The Connection contract: a two-sided (send/receive) byte pipe to one peer, for libraries without RDMA.

A TransferAgent (base.py) is one-sided: the reader names remote addresses and the transport fetches them.
Many libraries only send and receive (sockets, pipes, MPI, torch.distributed, NCCL). For those you write a
`Connection` and a `Listener`; `ConnectionAgent` (conn_agent.py) turns them into a full TransferAgent: a READ
becomes a request the peer's serving thread answers by sending the described regions, a WRITE a request the
peer answers by receiving into them. This is TensorRT-LLM's second customization point, next to its
one-sided agents. kvbridge ships `tcp` (tcp.py) and `gloo`/`nccl` (dist_connection.py).

Who calls what (all calls come from ConnectionAgent's threads, never from user code):

    listener = MyConnection.listen(options)                 # once, when the agent is created
    listener.endpoint()                                     # -> msgpack-able dict; goes into metadata()
    conn = listener.accept(timeout)                         # accept thread: next peer, or None after timeout
    conn.greet(deadline)                                    # its serving thread: the peer's opening, if any
    conn.answered(key)                                      # requester, after its proof: the peer's key
    conn.service()                                          # server, after the proof: a side channel's loop?
    conn = MyConnection.establish(endpoint, deadline, opts) # client thread: reach a peer's listener
    conn.send(buffer, deadline) / conn.recv(buffer, deadline)        # control messages (headers, descriptors)
    conn.send_regions(descs, deadline) / conn.recv_regions(descs, deadline)  # the bulk data
    conn.poll(timeout)                                      # serving thread: has the next message begun?
    conn.abort()                                            # any thread: make blocked calls return now
    conn.close(); listener.close()                          # owning thread, once

Rules every implementation keeps:
- Messages are matched: each `send(buffer)` is received by exactly one `recv` of a buffer of the same size
  on the other side, in order. Stream transports (TCP, pipes) satisfy this for free; message transports
  (torch.distributed) because both sides know every size from the protocol.
- `send`/`recv` move exactly len(buffer) bytes or raise: ConnectionClosed when the peer went away,
  ConnectionDeadline when `deadline` (a time.monotonic() value) passes, ConnectionFailed otherwise. After
  any raise the connection is dead: the agent closes it and makes a new one for the next transfer.
- Host buffers are 1-D uint8 numpy arrays; device buffers (only if `memory_kinds` has VRAM) 1-D uint8 CUDA
  tensors. `recv` writes into the caller's preallocated buffer; it never allocates per message.
- `poll(timeout)` returns True as soon as a message (or end of stream) is waiting, False after `timeout`
  seconds with nothing consumed; the serving thread calls it in short slices so that it can stop.
- `abort()` may be called from another thread while one is blocked in I/O; when it returns, the
  connection will not write into caller memory again. Override `_interrupt()` (e.g. shutdown a socket) so
  blocked calls return promptly; without it they return by their deadline.
- `send_regions`/`recv_regions` move the bytes of a DescriptorList (already bounds-checked by the agent)
  in order, as one stream. The default gathers into a reusable staging tensor and calls send/recv once per
  `staging_bytes` chunk; override them for scatter/gather I/O (TCP uses readv/writev straight into the
  registered memory) or for a separate bulk channel (torch.distributed).
- Nothing from the peer is unpickled or evaluated; frames are parsed by conn_wire.py.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar

from ..errors import ConnectionFailed, PeerError
from .base import DescriptorList, MemoryKind
from .staging import chunks, gather, scatter

__all__ = ["Connection", "Listener"]


class Listener(ABC):
    """The serving end: advertises an endpoint and accepts peers' connections."""

    @abstractmethod
    def endpoint(self) -> dict[str, Any]:
        """How peers reach this listener (plain msgpack-able values: str, int, bytes); put in metadata."""

    @abstractmethod
    def accept(self, timeout: float) -> "Connection | None":
        """The next incoming connection, or None if none arrived within `timeout` seconds.

        Raises ConnectionFailed only for a broken listener. It must not read from the peer (a caller that
        connects and says nothing would hold every other peer off): what the peer says first is read by
        `Connection.greet`, on the connection's own serving thread.
        """

    @abstractmethod
    def close(self) -> None:
        """Stop listening; later accept() calls return None."""


class Connection(ABC):
    """One established bidirectional pipe to one peer. See the module docstring for the contract.

    Class attributes a subclass sets:
        memory_kinds: memory it can move (DRAM only unless it sends/receives CUDA tensors).
        staging_bytes: chunk size of the default send_regions/recv_regions.
    Subclasses call `super().__init__()`.
    """

    memory_kinds: ClassVar[frozenset[MemoryKind]] = frozenset({MemoryKind.DRAM})
    staging_bytes: ClassVar[int] = 16 << 20

    def __init__(self) -> None:
        self._aborted = False
        self._copy_lock = threading.Lock()  # held while the default path scatters into caller memory
        self._staging: dict[tuple[MemoryKind, int], Any] = {}

    # --- set-up (class methods: called before there is a connection) --------------------------------
    @classmethod
    @abstractmethod
    def listen(cls, options: dict[str, Any]) -> Listener:
        """Start serving; `options` are the agent's constructor keywords (e.g. host)."""

    @classmethod
    @abstractmethod
    def establish(cls, endpoint: dict[str, Any], deadline: float, options: dict[str, Any]) -> "Connection":
        """Connect to a peer's listener by its endpoint(); raise ConnectionFailed/Deadline if it cannot."""

    @classmethod
    def check_endpoint(cls, endpoint: Any) -> None:
        """Validate an endpoint that came from a peer's metadata; raise PeerError naming what is wrong."""
        if not isinstance(endpoint, dict):
            raise PeerError(f"{cls.__name__} endpoint must be a map, got {type(endpoint).__name__}")

    def greet(self, deadline: float) -> None:
        """Server side, on this connection's serving thread before anything else: read and check what the peer
        sends first (a transport's own hello), raising ProtocolError or ConnectionFailed to drop it. Default:
        the transport has no opening."""

    def answered(self, key: bytes) -> None:
        """Requester side, once this connection answered the server's challenge with `key` (the peer's
        connection key, conn_wire.py): a transport that opens more connections to the same peer (gloo/nccl's
        rendezvous store) proves them with it. Default: nothing to keep."""

    def service(self) -> "Callable[[threading.Event], None] | None":
        """Server side, once the peer proved itself: None for a connection that carries READ/WRITE requests
        (the default), or the loop that serves this connection instead, when `greet` found it to be one of the
        transport's own side channels; the loop returns when the peer closes or the event is set."""
        return None

    # --- messages ----------------------------------------------------------------------------------------
    @abstractmethod
    def send(self, buffer, deadline: float) -> None:
        """Send all of `buffer` as one message (see the module docstring for buffer types and errors)."""

    @abstractmethod
    def recv(self, buffer, deadline: float) -> None:
        """Receive one message of exactly len(buffer) bytes into `buffer`."""

    @abstractmethod
    def poll(self, timeout: float) -> bool:
        """True once the next message (or the end of the stream) is waiting; False after `timeout` s."""

    # --- bulk data -------------------------------------------------------------------------------------
    def send_regions(self, descs: DescriptorList, deadline: float) -> None:
        """Send the bytes of every descriptor, in order, as one stream (default: staged chunks via send)."""
        for addrs, lengths, n in chunks(descs.addrs, descs.lengths, self.staging_bytes):
            buf = self._stage(descs.kind, descs.device)[:n]
            gather(descs.kind, descs.device, addrs, lengths, buf)
            if descs.kind is MemoryKind.VRAM:
                _sync(buf)
            self.send(_as_buffer(buf), deadline)

    def recv_regions(self, descs: DescriptorList, deadline: float) -> None:
        """Receive into every descriptor, in order, what the peer's send_regions sent."""
        for addrs, lengths, n in chunks(descs.addrs, descs.lengths, self.staging_bytes):
            buf = self._stage(descs.kind, descs.device)[:n]
            self.recv(_as_buffer(buf), deadline)
            with self._copy_lock:
                if self._aborted:
                    raise ConnectionFailed("connection aborted")
                scatter(descs.kind, descs.device, addrs, lengths, buf)
                if descs.kind is MemoryKind.VRAM:
                    _sync(buf)

    def _stage(self, kind: MemoryKind, device: int):
        """The reusable staging tensor for memory of kind/device (allocated on first use)."""
        buf = self._staging.get((kind, device))
        if buf is None:
            import torch

            dev = "cpu" if kind is MemoryKind.DRAM else f"cuda:{device}"
            buf = torch.empty(self.staging_bytes, dtype=torch.uint8, device=dev)
            self._staging[(kind, device)] = buf
        return buf

    # --- teardown --------------------------------------------------------------------------------------
    def abort(self) -> None:
        """From any thread: fail blocked and later calls; once this returns no caller memory is written."""
        self._aborted = True
        self._interrupt()
        with self._copy_lock:
            pass

    @property
    def aborted(self) -> bool:
        return self._aborted

    def _interrupt(self) -> None:
        """Make a send/recv blocked in another thread return promptly (optional; e.g. socket.shutdown)."""

    @abstractmethod
    def close(self) -> None:
        """Release the connection's resources (called once, by the thread that owns it)."""


def _as_buffer(t):
    """What send/recv take: a numpy view for host tensors, the tensor itself for device ones."""
    return t.numpy() if t.device.type == "cpu" else t


def _sync(t) -> None:
    import torch

    torch.cuda.current_stream(t.device).synchronize()

