"""A peer process for agent tests: owns a registered buffer of position-dependent values, answers commands.

Run through `Peer(spec, nbytes, device)`: it spawns a fresh interpreter (multiprocessing 'spawn'), which
creates the agent, fills and registers its buffer and sends back its metadata. Commands: connect to the
test's agent, dump the buffer, re-send metadata, exit. The pipe is between our own test processes.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def resolve(spec: str):
    """An agent class from a registry name ('nixl') or 'module:Class'."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    if ":" in spec:
        mod, _, attr = spec.partition(":")
        return getattr(importlib.import_module(mod), attr)
    from kvbridge.agents import get_agent_class

    return get_agent_class(spec)


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
    from kvbridge.agents import DescriptorList, MemoryKind

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


def _main(conn, spec: str, nbytes: int, device: str, seed: int) -> None:
    from kvbridge.agents import MemoryRegion

    cls = resolve(spec)
    agent = cls(f"peer-{os.getpid()}")
    buf = alloc(nbytes, device, seed)
    reg = agent.register_memory(MemoryRegion.of(buf))
    addr = reg.region.addr
    conn.send(("ready", agent.metadata(), addr))
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


class Peer:
    def __init__(self, spec: str, nbytes: int, device: str = "cpu", seed: int = 7) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_main, args=(child, spec, nbytes, device, seed), daemon=True)
        self.proc.start()
        if not self.conn.poll(60):
            raise TimeoutError("peer process did not start within 60 s")
        tag, self.metadata, self.addr = self.conn.recv()
        assert tag == "ready"
        self.nbytes, self.seed, self.device = nbytes, seed, device

    def call(self, cmd: str, arg=None, timeout: float = 60):
        self.conn.send((cmd, arg))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer did not answer {cmd!r} within {timeout} s")
        return self.conn.recv_bytes() if cmd == "dump" else self.conn.recv()

    def close(self) -> None:
        try:
            self.conn.send(("exit", None))
            self.conn.poll(30)
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
