"""The conformance checks: what every TransferAgent must do, one named function per rule.

Each check takes an open `Pair` (a local agent with a registered buffer, connected both ways to a peer
process that owns another) and returns normally or raises: `CheckFailed` naming what was wrong, or whatever
the agent raised. Buffers hold position-dependent values and are compared whole. Checks never leave the
local buffer changed (the runner restores it before each check) and wait on handles with the pair's deadline
only. Never asserts (the suite must also work under `python -O`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ...errors import AgentError, PeerError, RegistrationError, TransferFailed, TransferTimeout
from ..base import TransferAgent
from ..envelope import seal
from ..memory import DescriptorList, MemoryRegion, XferState
from .peer import Peer, alloc, descs, device_of, pattern, resolve, restore, to_numpy, warm_up

__all__ = ["CheckFailed", "Check", "Pair", "CHECKS", "NBYTES", "LOCAL_SEED", "PEER_SEED"]

NBYTES = 8 << 20
LOCAL_SEED, PEER_SEED, OTHER_SEED, EXTRA_SEED = 11, 3, 5, 9


class CheckFailed(Exception):
    """A conformance rule the agent broke; the message says which and how."""


def expect(ok: bool, message: str) -> None:
    if not ok:
        raise CheckFailed(message)


def same(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    """Whole-buffer comparison; names the first differing byte and how many differ."""
    if actual.shape != expected.shape:
        raise CheckFailed(f"{what}: {actual.size} bytes, expected {expected.size}")
    diff = np.flatnonzero(actual != expected)
    if diff.size:
        i = int(diff[0])
        raise CheckFailed(f"{what}: {diff.size} bytes differ, first at offset {i} "
                          f"(got {int(actual[i])}, expected {int(expected[i])})")


@dataclass
class Pair:
    """A local agent with a registered buffer and a peer process, connected both ways."""

    spec: str
    agent: TransferAgent
    buf: Any
    peer: Peer
    name: str
    timeout: float
    registration: Any = field(repr=False, default=None)

    @classmethod
    def open(cls, spec: str, local_device: str = "cpu", peer_device: str = "cpu", *, timeout: float = 30.0,
             nbytes: int = NBYTES, start_timeout: float | None = None) -> "Pair":
        warm_up()
        start = max(2 * timeout, 30.0) if start_timeout is None else start_timeout
        peer = Peer(spec, nbytes, peer_device, seed=PEER_SEED, start_timeout=start)
        try:
            agent = resolve(spec)(f"local-{os.getpid()}-{abs(hash(spec)) % 10000}")
        except BaseException:
            peer.close()
            raise
        buf = alloc(nbytes, local_device, seed=LOCAL_SEED)
        pair = cls(spec, agent, buf, peer, "", timeout)
        try:
            pair.registration = agent.register_memory(MemoryRegion.of(buf))
            pair.name = agent.connect(peer.metadata)
            peer.call("connect", agent.metadata(), timeout=timeout)
        except BaseException:
            pair.close()
            raise
        return pair

    @property
    def nbytes(self) -> int:
        return self.peer.nbytes

    def reset(self) -> None:
        """Put the local buffer back to its position-dependent pattern."""
        restore(self.buf, pattern(self.nbytes, LOCAL_SEED))

    def remote(self) -> np.ndarray:
        """The peer's whole buffer as it is now (read over the pipe, not through the agent)."""
        return np.frombuffer(self.peer.call("dump", timeout=self.timeout), dtype=np.uint8).copy()

    def run(self, op: str, local: DescriptorList, remote: DescriptorList) -> XferState:
        """Post a READ/WRITE, wait for it with the pair's deadline, release it; its final state."""
        h = (self.agent.read if op == "READ" else self.agent.write)(self.name, local, remote)
        try:
            h.wait(self.timeout)
        except TransferTimeout:
            raise CheckFailed(f"a {op} of {len(local)} descriptors was still not DONE after "
                              f"{self.timeout:g} s") from None
        finally:
            st = h.state()
            h.release()
        expect(st is XferState.DONE, f"wait() returned but state() is {st.name}, not DONE")
        return st

    def close(self) -> None:
        try:
            if self.registration is not None:
                self.registration.release()
            self.agent.close()
        finally:
            self.peer.close()


def scattered(rng, nbytes: int, count: int, max_len: int, lens=None):
    """`count` disjoint (offset, length) ranges inside nbytes, in random order, varied lengths."""
    slots = nbytes // max_len
    idx = rng.choice(slots, size=count, replace=False)
    if lens is None:
        lens = rng.integers(1, max_len + 1, size=count)
    offs = idx * max_len + rng.integers(0, max_len - lens + 1)
    return offs.astype(np.int64), lens.astype(np.int64)


def check_read_many_fragments(p: Pair) -> None:
    """READ of 3000 scattered fragments of varied lengths, independently placed on each side."""
    rng = np.random.default_rng(0)
    src_off, lens = scattered(rng, p.nbytes, 3000, 2048)
    dst_off, _ = scattered(rng, p.nbytes, 3000, 2048, lens)
    expected, remote = to_numpy(p.buf).copy(), p.remote()
    p.run("READ", descs(p.buf, dst_off, lens), descs(p.peer, src_off, lens))
    for d, s, n in zip(dst_off, src_off, lens):  # the oracle, not the data path
        expected[d:d + n] = remote[s:s + n]
    same(to_numpy(p.buf), expected, "local buffer after a scattered READ")


def check_write_many_fragments(p: Pair) -> None:
    """WRITE of 2000 scattered fragments; the peer's whole buffer is compared afterwards."""
    rng = np.random.default_rng(1)
    src_off, lens = scattered(rng, p.nbytes, 2000, 4096)
    dst_off, _ = scattered(rng, p.nbytes, 2000, 4096, lens)
    expected, local = p.remote(), to_numpy(p.buf)
    p.run("WRITE", descs(p.buf, src_off, lens), descs(p.peer, dst_off, lens))
    for s, d, n in zip(src_off, dst_off, lens):
        expected[d:d + n] = local[s:s + n]
    same(p.remote(), expected, "peer buffer after a scattered WRITE")


def check_read_large(p: Pair) -> None:
    """One contiguous READ of the whole buffer."""
    p.run("READ", descs(p.buf, [0], [p.nbytes]), descs(p.peer, [0], [p.nbytes]))
    same(to_numpy(p.buf), p.remote(), "local buffer after a whole-buffer READ")


def check_empty_transfer(p: Pair) -> None:
    """An empty descriptor list is a transfer that is DONE; release() twice is harmless."""
    h = p.agent.read(p.name, descs(p.buf, [], []), descs(p.peer, [], []))
    h.wait(min(p.timeout, 5.0))
    expect(h.state() is XferState.DONE, f"an empty READ is {h.state().name}, not DONE")
    h.release()
    h.release()


def check_register_deregister(p: Pair) -> None:
    """A newly registered region is usable at once; once released, the agent refuses to use it."""
    extra = alloc(1 << 16, device_of(p.buf), seed=EXTRA_SEED)
    reg = p.agent.register_memory(MemoryRegion.of(extra))
    try:
        p.run("READ", descs(extra, [0], [4096]), descs(p.peer, [0], [4096]))
        expected = pattern(1 << 16, EXTRA_SEED).copy()
        expected[:4096] = p.remote()[:4096]
        same(to_numpy(extra), expected, "a newly registered region after a READ into it")
    finally:
        reg.release()
    expect(reg.released, "Registration.released is False after release()")
    try:
        p.agent.read(p.name, descs(extra, [0], [4096]), descs(p.peer, [0], [4096])).release()
    except RegistrationError:
        return
    raise CheckFailed("a READ into a released registration was posted instead of raising RegistrationError")


def check_metadata_exchange(p: Pair) -> None:
    """Garbage, empty and foreign metadata raise PeerError; fresh metadata re-connects the same peer."""
    for blob, what in ((b"\x00garbage", "garbage bytes"), (b"", "empty bytes"),
                       (seal("someone-else", "x", {}), "another agent kind's envelope"),
                       (seal(p.agent.agent_kind, "x", {}), "an envelope with an empty payload")):
        try:
            p.agent.connect(blob)
        except PeerError:
            continue
        except Exception as e:  # noqa: BLE001 - the wrong exception type is the failure we report
            raise CheckFailed(f"connect() with {what} raised {type(e).__name__}: {e}, not PeerError") from None
        raise CheckFailed(f"connect() accepted {what}")
    name = p.agent.connect(p.peer.call("metadata", timeout=p.timeout))
    expect(name == p.name, f"re-connecting the same peer gave name {name!r}, first {p.name!r}")
    expect(name in p.agent.peers, f"peer {name!r} missing from agent.peers after connect()")
    p.run("READ", descs(p.buf, [0], [4096]), descs(p.peer, [4096], [4096]))
    same(to_numpy(p.buf)[:4096], p.remote()[4096:8192], "a READ after re-connecting")


def _refused(call: Callable[[], Any], exc: type[Exception], what: str) -> None:
    try:
        call().release()
    except exc:
        return
    raise CheckFailed(f"{what} was posted instead of raising {exc.__name__}")


def check_bad_local_descriptors(p: Pair) -> None:
    """Local ranges outside every registration, unknown peers and mismatched lists are refused at post."""
    d = descs(p.buf, [0], [64])
    _refused(lambda: p.agent.read(p.name, descs(p.buf, [p.nbytes - 8], [16]), descs(p.peer, [0], [16])),
             RegistrationError, "a READ into a local range running past the registration")
    _refused(lambda: p.agent.read("nobody", d, d), PeerError, "a READ naming an unknown peer")
    _refused(lambda: p.agent.read(p.name, d, descs(p.peer, [0, 64], [64, 64])), AgentError,
             "a READ with 1 local and 2 remote descriptors")
    _refused(lambda: p.agent.write(p.name, d, descs(p.peer, [0], [32])), AgentError,
             "a WRITE whose local and remote lengths differ")


def _never_done(p: Pair, op: str, local: DescriptorList, remote: DescriptorList, what: str) -> None:
    try:
        h = (p.agent.read if op == "READ" else p.agent.write)(p.name, local, remote)
    except AgentError:
        return  # refused at post: the best answer
    try:
        h.wait(p.timeout)
    except TransferFailed:
        return
    except TransferTimeout:
        raise CheckFailed(f"{what}: still PENDING after {p.timeout:g} s (must fail)") from None
    finally:
        h.release()
    raise CheckFailed(f"{what}: completed DONE (must raise AgentError at post or end FAILED)")


def check_bad_remote_descriptors(p: Pair) -> None:
    """Remote ranges the peer never registered never complete: refused at post or FAILED."""
    n = p.nbytes
    _never_done(p, "READ", descs(p.buf, [0], [4096]), descs(p.peer, [n - 1024], [4096]),
                "a READ of a remote range running 3072 bytes past the peer's buffer")
    _never_done(p, "WRITE", descs(p.buf, [0], [4096]), descs(p.peer, [n + (64 << 20)], [4096]),
                "a WRITE to a remote address 64 MiB past the peer's buffer")
    same(to_numpy(p.buf), pattern(n, LOCAL_SEED), "local buffer after refused transfers")


def check_status_and_wait(p: Pair) -> None:
    """state() answers at once; wait(0) returns or raises TransferTimeout at once; then wait(t) finishes."""
    h = p.agent.read(p.name, descs(p.buf, [0], [p.nbytes]), descs(p.peer, [0], [p.nbytes]))
    try:
        st = h.state()
        expect(isinstance(st, XferState), f"state() returned {st!r}, not an XferState")
        t0 = time.monotonic()
        try:
            h.wait(0.0)
        except TransferTimeout:
            pass
        took = time.monotonic() - t0
        expect(took < 1.0, f"wait(0) took {took:.2f} s: wait must never block past its timeout")
        try:
            h.wait(p.timeout)
        except TransferTimeout:
            raise CheckFailed(f"a whole-buffer READ was still PENDING after wait({p.timeout:g})") from None
        expect(h.state() is XferState.DONE, f"after wait() returned, state() is {h.state().name}")
    finally:
        h.release()
    same(to_numpy(p.buf), p.remote(), "local buffer after wait()")


def _settle_after_cancel(h, bound: float) -> XferState:
    deadline = time.monotonic() + bound
    while h.state() is XferState.PENDING and time.monotonic() < deadline:
        time.sleep(0.001)  # polling the handle's own state, bounded: this is the wait on the event
    return h.state()


def check_cancel(p: Pair) -> None:
    """cancel() of a PENDING transfer ends it FAILED (never DONE) within the deadline; of a DONE one, nothing."""
    n, frag = p.nbytes // 4096, 4096
    perm = np.random.default_rng(2).permutation(n).astype(np.int64)
    remote = p.remote()
    h = p.agent.read(p.name, descs(p.buf, np.arange(n) * frag, np.full(n, frag)),
                     descs(p.peer, perm * frag, np.full(n, frag)))
    try:
        asked = h.cancel()
        st = _settle_after_cancel(h, p.timeout)
        expect(st is not XferState.PENDING, f"a cancelled READ was still PENDING {p.timeout:g} s after cancel()")
        expect(not (asked and st is XferState.DONE),
               "cancel() was accepted while the READ was PENDING, yet it ended DONE (must end FAILED)")
        expect(h.cancel() is False, "a second cancel() of a settled transfer asked again")
    finally:
        h.release()
    if st is XferState.DONE:  # it finished before cancel(): then every byte must be right
        same(to_numpy(p.buf), remote.reshape(n, frag)[perm].reshape(-1), "a READ that finished before cancel()")
    p.reset()  # nothing may land after the settled state: a fresh READ must leave exactly its own bytes
    p.run("READ", descs(p.buf, [0], [frag]), descs(p.peer, [frag], [frag]))
    expected = pattern(p.nbytes, LOCAL_SEED).copy()
    expected[:frag] = remote[frag:2 * frag]
    same(to_numpy(p.buf), expected, "local buffer after a cancelled READ settled and a new READ ran")


def check_peer_dies(p: Pair) -> None:
    """Transfers to a SIGKILLed peer settle within the deadline: they fail (or raise at post), or, on a
    transport that maps the peer's memory, end DONE with exactly its last bytes; other peers still work."""
    other = Peer(p.spec, 1 << 20, p.peer.device, seed=OTHER_SEED, start_timeout=max(p.timeout, 60.0))
    try:
        oname = p.agent.connect(other.metadata)
        other.call("connect", p.agent.metadata(), timeout=p.timeout)
        h = p.agent.read(oname, descs(p.buf, [0], [4096]), descs(other, [0], [4096]))
        h.wait(p.timeout)
        h.release()
        same(to_numpy(p.buf)[:4096], pattern(1 << 20, OTHER_SEED)[:4096], "a READ from the second peer")
        other.kill()
        try:
            h = p.agent.read(oname, descs(p.buf, [0], [1 << 20]), descs(other, [0], [1 << 20]))
        except AgentError:
            h = None
        if h is not None:
            st = _wait_settled(h, p.timeout)
            h.release()
            expect(st is not XferState.PENDING, f"a READ from a dead peer was still PENDING after {p.timeout:g} s")
            if st is XferState.DONE:  # a mapped transport (CUDA IPC) keeps a dead peer's memory alive while
                # mapped: DONE is allowed only with exactly the peer's last bytes (the control plane's
                # confirmation, not the agent, is what notices the death); anything else must be FAILED
                same(to_numpy(p.buf)[:1 << 20], pattern(1 << 20, OTHER_SEED),
                     "a READ from a SIGKILLed peer that ended DONE")
        p.agent.disconnect(oname)
        expect(oname not in p.agent.peers, "disconnect() left the dead peer in agent.peers")
    finally:
        other.kill()
    p.reset()
    check_read_large(p)


def _wait_settled(h, bound: float) -> XferState:
    try:
        h.wait(bound)
    except (TransferFailed, TransferTimeout):
        pass
    return h.state()


@dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[Pair], None]

    @property
    def doc(self) -> str:
        return (self.run.__doc__ or "").strip().splitlines()[0]


CHECKS: tuple[Check, ...] = (
    Check("register-deregister", check_register_deregister),
    Check("metadata-exchange", check_metadata_exchange),
    Check("read-many-fragments", check_read_many_fragments),
    Check("write-many-fragments", check_write_many_fragments),
    Check("read-large", check_read_large),
    Check("empty-transfer", check_empty_transfer),
    Check("status-and-wait", check_status_and_wait),
    Check("bad-local-descriptors", check_bad_local_descriptors),
    Check("bad-remote-descriptors", check_bad_remote_descriptors),
    Check("cancel", check_cancel),
    Check("peer-dies", check_peer_dies),
)
