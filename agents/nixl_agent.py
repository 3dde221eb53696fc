"""NixlAgent: one-sided READ/WRITE through NIXL's UCX backend (host DRAM and CUDA VRAM).

UCX picks the transport per peer pair: shared memory / CMA between processes of one host, cuda_ipc between
GPUs of one host, RDMA or TCP across hosts. NIXL runs its own progress thread; this class only posts and
polls. `nixl-cu13` is an optional dependency (`pip install 'kvbridge[nixl]'`), imported lazily: a machine
without it (or where its native library cannot load) still imports kvbridge, uses the other agents, and gets
an error saying what to install when it asks for this one.

Why NIXL and not UCX directly: ucx-py cannot be installed from PyPI and ucxx exposes no RMA to Python.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
import weakref

from ..errors import AgentError, PeerError
from .base import DescriptorList, MemoryKind, MemoryRegion, TransferAgent, TransferHandle, XferState
from .envelope import field, open_envelope, seal

log = logging.getLogger(__name__)

_nixl = None
_nixl_lock = threading.Lock()

# UCX's TCP transport sends in segments of UCX_TCP_TX_SEG_SIZE and receives into UCX_TCP_RX_SEG_SIZE (8 KiB and
# 64 KiB unless set). A peer whose send segment exceeds our receive segment makes UCX fail the connection and
# abort the sending process on the first transfer over TCP; each agent advertises both and refuses such a peer.
_UCX_TCP_SEGMENTS = (("tcp_tx_seg", "UCX_TCP_TX_SEG_SIZE", 8 << 10), ("tcp_rx_seg", "UCX_TCP_RX_SEG_SIZE", 64 << 10))
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "g": 1 << 30, "gb": 1 << 30}


def ucx_tcp_segments() -> dict[str, int]:
    """{"tcp_tx_seg": bytes, "tcp_rx_seg": bytes} as UCX will read them from this process's environment (a
    value kvbridge cannot parse is left out: not checked)."""
    out = {}
    for key, env, default in _UCX_TCP_SEGMENTS:
        text = os.environ.get(env, "").strip().lower()
        num = text.rstrip("kmgb")
        if not text:
            out[key] = default
        elif num.isdigit() and text[len(num):] in _UNITS:
            out[key] = int(num) * _UNITS[text[len(num):]]
    return out


def _load_nixl():
    global _nixl
    with _nixl_lock:
        if _nixl is None:
            # NIXL logs every agent and backend creation at INFO; keep that out of users' terminals.
            os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
            logging.getLogger("nixl").setLevel(logging.WARNING)
            try:
                import nixl_cu13 as mod  # type: ignore[import-not-found]
            except ImportError:
                try:
                    from nixl import _api as mod  # type: ignore[import-not-found,no-redef]
                except ImportError as e:
                    raise AgentError(
                        "the nixl agent needs the `nixl-cu13` package: pip install 'kvbridge[nixl]' (or "
                        "pip install nixl-cu13); without it use another agent, e.g. `transceiver: {agent: "
                        f"tcp}}` for host memory; importing it failed: {e}"
                    ) from e
            _nixl = mod
        return _nixl


class NixlTransfer(TransferHandle):
    """A NIXL transfer request; state polled from NIXL; after cancel() it reports FAILED once NIXL settles."""

    def __init__(self, nx, xfer, ndesc: int, nbytes: int, first: str, timed: bool = False) -> None:
        super().__init__(ndesc, nbytes)
        self._nx = nx  # the agent's nixl_agent binding, which owns the request
        self._xfer = xfer
        self._timed_by_nixl = timed  # the agent captures NIXL telemetry: keep NIXL's span once DONE
        self._final: XferState | None = None
        self._cancelled = False
        if first == "DONE":
            self._final = XferState.DONE
            self._timed()
        elif first == "ERR":
            self._final = XferState.FAILED
            self.error = "NIXL refused to post the transfer"

    def state(self) -> XferState:
        if self._final is not None:
            return self._final
        try:
            s = self._nx.check_xfer_state(self._xfer)
        except Exception as e:  # noqa: BLE001 - the binding raises its own types
            self.error = f"NIXL status check failed: {e}"
            s = "ERR"
        if s == "DONE":
            self._final = XferState.FAILED if self._cancelled else XferState.DONE
            self._timed()
        elif s == "ERR":
            self._final = XferState.FAILED
            self.error = self.error or "NIXL reported a transfer error (peer gone or memory invalid)"
        return self._final or XferState.PENDING

    def _timed(self) -> None:
        """Keep NIXL's own timing of this transfer (agents made with `telemetry`), as vLLM's NixlConnector
        reports it: (start, start + xferDuration) in microseconds."""
        if self._xfer is None or not self._timed_by_nixl:
            return
        try:
            t = self._nx.get_xfer_telemetry(self._xfer)
            self.transport_span = (float(t.startTime), float(t.startTime) + float(t.xferDuration))
        except Exception:  # noqa: BLE001 - a diagnostic only; the transfer's outcome stands
            pass

    def _cancel(self) -> None:
        # NIXL cannot stop data already in flight (releasing the request or forgetting the peer does not stop
        # a UCX read over TCP: bytes still land once the link returns). So a cancelled transfer stays PENDING
        # until NIXL says it settled, then reports FAILED: callers wait for that before reusing the memory.
        self._cancelled = True

    def _do_release(self) -> None:
        self._drop()

    def __del__(self) -> None:
        # Garbage-collected unreleased (warned as for any handle): NIXL's request object releases itself when it
        # is collected, and in a collected cycle it may already have done so, but without noting it, so a
        # release from here would free the request twice (a crash). So drop the reference only.
        if not getattr(self, "_released", True):
            warnings.warn(f"{type(self).__name__} was not released; NIXL releases it", ResourceWarning,
                          stacklevel=2)
            self._released, self._xfer = True, None

    def abandon(self) -> None:
        """The agent is closing: release NIXL's request now (a later `release` does nothing more); a state
        not known by then reads FAILED."""
        if self._final is None:
            self._final = XferState.FAILED
            self.error = self.error or "the NIXL agent was closed before this transfer settled"
        self._drop()

    def _drop(self) -> None:
        x, self._xfer = self._xfer, None
        if x is not None:
            try:
                self._nx.release_xfer_handle(x)
            except Exception as e:  # noqa: BLE001
                log.warning("NIXL could not release a transfer handle: %s", e)


class NixlAgent(TransferAgent):
    """TransferAgent over NIXL (UCX backend).

    Args:
        name: unique among the peers this agent talks to (NIXL keys remote agents by name).
        backends: NIXL backends to create; UCX by default.
        num_threads: UCX worker threads (0: NIXL's default).
        progress: who drives UCX. "thread" (default): a kvbridge thread progresses the worker every
            `progress_interval_s` (UCX needs the target side to progress for connection wire-up and emulated
            RMA; NIXL's own progress thread polls without pause and burns a whole core per agent even when
            idle). "nixl": NIXL's progress thread (lowest latency, one busy core). "manual": the owner calls
            `progress()` often (e.g. from an I/O loop that already wakes up).
        progress_interval_s: the "thread" mode's period.
        idle_progress_s: the "thread" mode's period while nobody said a peer may be reading
            (`expect_reads`): an owner that knows when peers read (the transceiver's sender) sets it longer,
            so an idle thread stops taking the GIL and a core every `progress_interval_s`. Default:
            `progress_interval_s`.
        telemetry: NIXL times every transfer (its `capture_telemetry`); a DONE handle's `transport_span` then
            holds NIXL's (start, end), the measure vLLM's NixlConnector reports as its transfer time.
    """

    agent_kind = "nixl"
    memory_kinds = frozenset({MemoryKind.DRAM, MemoryKind.VRAM})

    def __init__(self, name: str, *, backends: tuple[str, ...] = ("UCX",), num_threads: int = 0,
                 progress: str = "thread", progress_interval_s: float = 0.0005,
                 idle_progress_s: float | None = None, telemetry: bool = False) -> None:
        super().__init__(name)
        if progress not in ("thread", "nixl", "manual"):
            raise AgentError(f"NixlAgent progress must be 'thread', 'nixl' or 'manual', got {progress!r}")
        mod = _load_nixl()
        cfg = mod.nixl_agent_config(
            enable_prog_thread=progress == "nixl",
            backends=list(backends),
            num_threads=num_threads,
            sync_mode=mod.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
            capture_telemetry=bool(telemetry),
        )
        try:
            self._nx = mod.nixl_agent(name, cfg)
        except Exception as e:  # noqa: BLE001
            raise AgentError(f"could not create NIXL agent {name!r}: {e}") from e
        self._telemetry = bool(telemetry)
        self._tcp_segments = ucx_tcp_segments()  # what UCX read when this agent was made
        missing = [b for b in backends if b not in self._nx.backends]
        if missing:
            raise AgentError(f"NIXL backends {missing} are not available (plugins: {self._nx.plugin_list})")
        self._reg_descs: dict[int, object] = {}
        # NIXL transfer requests not released yet: released at close, while the agent still holds its memory and
        # peers (a request released after them, e.g. by the garbage collector, crashed the process)
        self._live: weakref.WeakSet = weakref.WeakSet()
        self._stop_progress = threading.Event()
        self._kick = threading.Event()  # set by `expect_reads` and close: the progress thread looks now
        self._idle_s = progress_interval_s if idle_progress_s is None else float(idle_progress_s)
        self._fast_until = 0.0  # time.monotonic() until which peers may be reading: progress_interval_s
        self._progress_thread = None
        if progress == "thread":
            self._progress_thread = threading.Thread(target=self._progress_loop, args=(progress_interval_s,),
                                                     name=f"kvb-nixl-progress-{name}", daemon=True)
            self._progress_thread.start()

    def progress(self) -> None:
        """Drive UCX once (connection wire-up, emulated RMA on the target side, completions)."""
        try:
            self._nx.get_new_notifs()
        except Exception as e:  # noqa: BLE001 - progress must never raise into its caller
            log.debug("NIXL progress failed: %s", e)

    @property
    def fast_progress(self) -> bool:
        """Whether the progress thread runs every `progress_interval_s` now (peers may be reading)."""
        return time.monotonic() < self._fast_until or self._idle_s <= 0

    def expect_reads(self, seconds: float) -> None:
        """Peers may read this agent's memory for the next `seconds` (0: no longer): the progress thread runs
        every `progress_interval_s` until then, `idle_progress_s` after. Any thread; never blocks."""
        fast_until = time.monotonic() + seconds
        was_idle = self._fast_until < fast_until and self._fast_until <= time.monotonic()
        self._fast_until = fast_until
        if was_idle:
            self._kick.set()

    def _progress_loop(self, interval: float) -> None:
        while not self._stop_progress.is_set():
            self._kick.wait(interval if time.monotonic() < self._fast_until else self._idle_s)
            self._kick.clear()
            if self._stop_progress.is_set():
                return
            self.progress()

    def _register(self, region: MemoryRegion, key: int) -> None:
        try:
            self._reg_descs[key] = self._nx.register_memory(
                [(region.addr, region.length, region.device, "")], region.kind.value)
        except Exception as e:  # noqa: BLE001
            raise AgentError(f"NIXL could not register {region}: {e}") from e

    def _unregister(self, region: MemoryRegion, key: int) -> None:
        descs = self._reg_descs.pop(key, None)
        if descs is not None:
            self._nx.deregister_memory(descs)

    def _metadata(self) -> bytes:
        return seal(self.agent_kind, self.name, {"nixl": self._nx.get_agent_metadata(), **self._tcp_segments})

    def _connect(self, peer_metadata: bytes) -> str:
        name, payload = open_envelope(peer_metadata, self.agent_kind)
        blob = field(payload, "nixl", bytes)
        if name == self.name:
            raise PeerError(f"peer metadata carries this agent's own name {name!r}; names must be unique")
        self._check_tcp_segments(name, payload)
        if name in self.peers:
            self._nx.remove_remote_agent(name)  # the peer restarted: forget its old registrations
        try:
            got = self._nx.add_remote_agent(blob)
        except Exception as e:  # noqa: BLE001
            raise PeerError(f"NIXL rejected the metadata of peer {name!r}: {e}") from e
        got = got.decode() if isinstance(got, bytes) else str(got)
        if got != name:
            self._nx.remove_remote_agent(got)
            raise PeerError(f"peer metadata names {name!r} in its envelope but {got!r} inside")
        return name

    def _check_tcp_segments(self, name: str, payload: dict) -> None:
        """PeerError when either side would send UCX TCP segments larger than the other receives (a peer that
        advertises nothing, an older kvbridge, is not checked)."""
        mine = self._tcp_segments
        for sender, receiver, who in ((payload, mine, f"peer {name!r}"), (mine, payload, "this agent")):
            tx, rx = sender.get("tcp_tx_seg"), receiver.get("tcp_rx_seg")
            if isinstance(tx, int) and isinstance(rx, int) and not isinstance(tx, bool) and tx > rx:
                raise PeerError(
                    f"{who} sends UCX TCP segments of {tx} bytes (UCX_TCP_TX_SEG_SIZE) but the other side receives "
                    f"{rx} (UCX_TCP_RX_SEG_SIZE): UCX would abort the sender on the first transfer over TCP; set "
                    f"both alike on every worker (docs/nixl-tcp.md)")

    def _disconnect(self, peer: str) -> None:
        try:
            self._nx.remove_remote_agent(peer)
        except Exception as e:  # noqa: BLE001
            log.warning("NIXL could not remove peer %s: %s", peer, e)

    def _post(self, op: str, peer: str, local: DescriptorList, remote: DescriptorList) -> TransferHandle:
        if not len(local):
            return NixlTransfer(self._nx, None, 0, 0, "DONE")
        nx = self._nx
        try:
            xfer = nx.initialize_xfer(op, nx.get_xfer_descs(local.as_nixl(), local.kind.value),
                                      nx.get_xfer_descs(remote.as_nixl(), remote.kind.value), peer)
        except Exception as e:  # noqa: BLE001
            raise AgentError(f"NIXL refused a {op} of {len(local)} descriptors from {peer!r} "
                             f"(are the remote ranges inside memory the peer registered?): {e}") from e
        try:
            first = nx.transfer(xfer)
        except Exception as e:  # noqa: BLE001
            nx.release_xfer_handle(xfer)
            raise AgentError(f"NIXL could not post a {op} to {peer!r}: {e}") from e
        handle = NixlTransfer(self._nx, xfer, len(local), local.nbytes, first, self._telemetry)
        self._live.add(handle)
        return handle

    def _close(self) -> None:
        self._stop_progress.set()
        self._kick.set()
        if self._progress_thread is not None:
            self._progress_thread.join(5)
        for handle in list(self._live):  # its owner never released it (a transceiver closed mid-read)
            handle.abandon()
        for key in list(self._reg_descs):
            try:
                self._nx.deregister_memory(self._reg_descs.pop(key))
            except Exception:  # noqa: BLE001
                pass
        self._nx = _ClosedNixl()


class _ClosedNixl:
    """Stands in for the native agent after close(), so late handle releases are harmless no-ops."""

    def release_xfer_handle(self, _x) -> None:
        pass

    def check_xfer_state(self, _x) -> str:
        return "ERR"

    def get_new_notifs(self) -> dict:
        return {}
