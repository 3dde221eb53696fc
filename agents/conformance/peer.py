"""The conformance suite's peer: a separate process that owns a registered buffer of position-dependent
values and answers commands over a multiprocessing pipe (between our own processes, never the network).

`Peer(spec, nbytes, device)` spawns a fresh interpreter ('spawn'), which builds the agent named by `spec`,
fills and registers its buffer and sends back its metadata. Commands: connect to the caller's agent, dump the
buffer, re-send metadata, exit; `kill()` ends it with SIGKILL (the "peer that dies" check). Every wait on the
pipe has a deadline. Also holds the small buffer helpers the checks share (`pattern`, `alloc`, `descs`).
"""

from __future__ import annotations

import faulthandler
import importlib
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
import traceback

import numpy as np

__all__ = ["Peer", "PeerStartError", "resolve", "warm_up", "pattern", "alloc", "to_numpy", "device_of",
           "descs", "restore"]


def resolve(spec: str):
    """An agent class from a registry name ('nixl') or 'module:Class'.

    The module is looked up on sys.path plus the current directory (so `examples.custom_agent:CmaAgent`
    works from a checkout's root), then inside the kvbridge package (`kvbridge.examples.custom_agent`).
    """
    from ..base import TransferAgent
    from ..registry import get_agent_class

    if ":" not in spec:
        return get_agent_class(spec)
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    mod_name, _, attr = spec.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        if e.name != mod_name.partition(".")[0]:
            raise
        mod = importlib.import_module(f"kvbridge.{mod_name}")
    cls = getattr(mod, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, TransferAgent)):
        raise TypeError(f"{spec}: {attr!r} in {mod.__name__} is not a TransferAgent subclass")
    return cls


def warm_up() -> None:
    """Import torch now if it is installed: kvbridge's staging copies load it on first use, and its import
    (seconds on a busy machine) must not be charged to the first transfer's deadline."""
    try:
        import torch  # noqa: F401
    except ImportError:
        pass


def pattern(nbytes: int, seed: int) -> np.ndarray:
    """nbytes of position-dependent values (no two 8-byte words equal within a buffer, differ per seed)."""
    words = np.arange(nbytes // 8, dtype=np.int64) * 0x9E3779B1 + (seed << 40) + 0x5DEECE66D
    return words.view(np.uint8)


def alloc(nbytes: int, device: str, seed: int):
    """A contiguous buffer filled with `pattern`: numpy for 'cpu', a torch uint8 tensor for 'cuda:N'."""
    host = pattern(nbytes, seed).copy()
    if device == "cpu":
        return host
    import torch

    return torch.from_numpy(host).to(device)


def to_numpy(buf) -> np.ndarray:
    return buf if isinstance(buf, np.ndarray) else buf.cpu().numpy()


def device_of(owner) -> str:
    """'cpu' or 'cuda:N': where a buffer from `alloc` (or a Peer's buffer) lives."""
    if isinstance(owner, Peer):
        return owner.device
    return "cpu" if isinstance(owner, np.ndarray) else str(owner.device)


def addr_of(buf) -> int:
    return int(buf.ctypes.data) if isinstance(buf, np.ndarray) else int(buf.data_ptr())


def descs(owner, offsets, lengths):
    """A DescriptorList of byte ranges (offsets from the start) of a local buffer or of a Peer's buffer."""
    from ..memory import DescriptorList, MemoryKind

    base = owner.addr if isinstance(owner, Peer) else addr_of(owner)
    dev = device_of(owner)
    addrs = base + np.asarray(offsets, dtype=np.int64)
    if dev == "cpu":
        return DescriptorList(addrs, lengths)
    return DescriptorList(addrs, lengths, MemoryKind.VRAM, int(dev.partition(":")[2] or 0))


def restore(buf, values: np.ndarray) -> None:
    """Overwrite a buffer from `alloc` with host bytes, finished before returning (GPU copies included)."""
    if isinstance(buf, np.ndarray):
        buf[:] = values
        return
    import torch

    buf.copy_(torch.from_numpy(values))
    torch.cuda.synchronize(buf.device)


def _main(conn, spec: str, nbytes: int, device: str, seed: int, stack_file: str) -> None:
    from ..memory import MemoryRegion

    # The parent sends SIGUSR1 to a peer that does not start in time: every thread's stack goes to this file.
    with open(stack_file, "w") as stacks:
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
        try:
            warm_up()
            cls = resolve(spec)
            agent = cls(f"peer-{os.getpid()}")
            buf = alloc(nbytes, device, seed)
            reg = agent.register_memory(MemoryRegion.of(buf))
            ready = ("ready", agent.metadata(), reg.region.addr)
        except BaseException:  # noqa: BLE001 - the parent prints it once, in place of a bare exit code
            conn.send(("error", traceback.format_exc()))
            return
        faulthandler.unregister(signal.SIGUSR1)
    conn.send(ready)
    while conn.poll(120):
        cmd, arg = conn.recv()
        if cmd == "connect":
            conn.send(agent.connect(arg))
        elif cmd == "dump":
            if device != "cpu":
                import torch

                torch.cuda.synchronize()
            conn.send_bytes(to_numpy(buf).tobytes())
        elif cmd == "metadata":
            conn.send(agent.metadata())
        elif cmd == "exit":
            break
    reg.release()
    agent.close()
    conn.send("bye")


class PeerStartError(RuntimeError):
    """The peer process could not start the agent: its traceback, or where it hangs, is in the message."""


class Peer:
    """The peer process; `call(cmd)` talks to it with a deadline, `close()` ends it, `kill()` kills it."""

    def __init__(self, spec: str, nbytes: int, device: str = "cpu", seed: int = 7,
                 start_timeout: float = 60.0) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        fd, stack_file = tempfile.mkstemp(prefix="kvbridge-peer-stack-", suffix=".txt")
        os.close(fd)
        try:
            self.proc = ctx.Process(target=_main, args=(child, spec, nbytes, device, seed, stack_file),
                                    daemon=True)
            self.proc.start()
            deadline = time.monotonic() + start_timeout
            while not self.conn.poll(0.2) and self.proc.is_alive() and time.monotonic() < deadline:
                pass  # a bounded wait that also notices a peer that died while starting
            if not self.conn.poll(0):
                raise self._start_failed(spec, start_timeout, stack_file)
        finally:
            os.unlink(stack_file)
        msg = self.conn.recv()
        if isinstance(msg, tuple) and len(msg) == 2 and msg[0] == "error":
            self.kill()
            raise PeerStartError(f"the {spec} peer process failed while starting:\n{msg[1].rstrip()}")
        if not (isinstance(msg, tuple) and len(msg) == 3 and msg[0] == "ready"):
            self.kill()
            raise RuntimeError(f"the {spec} peer process sent {msg!r} instead of its metadata")
        _, self.metadata, self.addr = msg
        self.nbytes, self.seed, self.device = nbytes, seed, device

    def _start_failed(self, spec: str, start_timeout: float, stack_file: str) -> Exception:
        """The error for a peer that neither sent its metadata nor an error: it died, or it hangs (then every
        thread's stack, dumped by faulthandler on SIGUSR1, says where)."""
        if not self.proc.is_alive():
            self.proc.join(5)
            return PeerStartError(f"the {spec} peer process exited with code {self.proc.exitcode} before it "
                                  f"sent its metadata (no Python traceback: it died in native code or was "
                                  f"killed)")
        stacks = ""
        try:
            os.kill(self.proc.pid, signal.SIGUSR1)
            end, last = time.monotonic() + 10, None
            while time.monotonic() < end and not (stacks and stacks == last):  # written, no longer growing
                time.sleep(0.2)
                last = stacks
                with open(stack_file) as f:
                    stacks = f.read()
        except OSError:
            pass
        self.kill()
        where = f"; where it hangs (every thread's stack):\n{stacks.rstrip()}" if stacks.strip() else \
            "; it did not answer a request for its stack either"
        return PeerStartError(f"the {spec} peer process hangs: it did not send its metadata within "
                              f"{start_timeout:g} s{where}")

    def call(self, cmd: str, arg=None, timeout: float = 60):
        self.conn.send((cmd, arg))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer did not answer {cmd!r} within {timeout} s")
        return self.conn.recv_bytes() if cmd == "dump" else self.conn.recv()

    def kill(self) -> None:
        """SIGKILL the peer and reap it (bounded): it dies without releasing anything."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(30)

    def close(self) -> None:
        if not self.proc.is_alive():
            self.proc.join(1)
            return
        try:
            self.conn.send(("exit", None))
            self.conn.poll(30)
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
