"""Deliberately broken agents (fault injection) that `kvbridge check-agent` must fail, each with the check
that names its fault. All are the example CmaAgent with one rule broken in its handle:

- WrongBytesAgent: every READ lands with one byte flipped.
- NeverCompletesAgent: posts nothing; its handles stay PENDING forever.
- IgnoresCancelAgent: cancel() is ignored; a cancelled READ still ends DONE (the handle reports PENDING for
  its first second, like a slow link, so that cancel() always finds it running).
"""

from __future__ import annotations

import ctypes
import time

from examples.custom_agent import CmaAgent
from kvbridge.agents import DescriptorList, TransferHandle, XferState


class _Wrapped(TransferHandle):
    """A handle around the CmaAgent's own one; subclasses change one behaviour."""

    def __init__(self, inner: TransferHandle) -> None:
        super().__init__(inner.num_descriptors, inner.nbytes)
        self.inner = inner

    def state(self) -> XferState:
        st = self.inner.state()
        self.error = self.error or self.inner.error
        return st

    def _cancel(self) -> None:
        self.inner.cancel()

    def _do_release(self) -> None:
        self.inner.release()


class _FlipsOneByte(_Wrapped):
    def __init__(self, inner: TransferHandle, addr: int) -> None:
        super().__init__(inner)
        self._addr, self._flipped = addr, False

    def state(self) -> XferState:
        st = super().state()
        if st is XferState.DONE and not self._flipped:
            self._flipped = True
            byte = ctypes.c_uint8.from_address(self._addr)
            byte.value ^= 0x5A
        return st


class WrongBytesAgent(CmaAgent):
    def _post(self, op: str, peer: str, local: DescriptorList, remote: DescriptorList) -> TransferHandle:
        h = super()._post(op, peer, local, remote)
        if op != "READ" or not len(local):
            return h
        return _FlipsOneByte(h, int(local.addrs[len(local) // 2]) + int(local.lengths[len(local) // 2]) - 1)


class _Stuck(TransferHandle):
    def state(self) -> XferState:
        return XferState.PENDING


class NeverCompletesAgent(CmaAgent):
    def _post(self, op: str, peer: str, local: DescriptorList, remote: DescriptorList) -> TransferHandle:
        return _Stuck(len(local), local.nbytes)


class _IgnoresCancel(_Wrapped):
    def state(self) -> XferState:
        st = super().state()
        if st is XferState.DONE and time.monotonic() < self.posted_at + 1.0:
            return XferState.PENDING  # a slow link: the bytes are there, the completion is not yet
        return st

    def _cancel(self) -> None:
        pass  # the fault: the transfer goes on and ends DONE as if cancel() had never been called


class IgnoresCancelAgent(CmaAgent):
    def _post(self, op: str, peer: str, local: DescriptorList, remote: DescriptorList) -> TransferHandle:
        return _IgnoresCancel(super()._post(op, peer, local, remote))
