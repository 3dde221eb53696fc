"""Rank processes of ranks.py with one fault installed before they serve (fault injection only; the rest is
the real rank: real transceiver, real ZeroMQ, real agent):

- `agents`: transfer agents registered by name in the rank process, e.g. GatedAgent below as "cma".
- `breaks`: "hash" (the verification hash raises) or "unpack" (unpacking a staged piece raises), on the
  generation side's worker thread.

GatedAgent is the example CmaAgent whose READ handles stay PENDING until a gate file exists and ignore
cancel(): a transport whose reads can neither be aborted nor be seen to finish (the bytes land at post).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys

from .ranks import ROOT, RankProc, _serve

GATED = "tests.transceiver.fault_ranks:GatedAgent"


def _serve_with(conn, agents: dict, breaks: str | None) -> None:
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from kvbridge.agents import register_agent

    for name, target in agents.items():
        register_agent(name, target, replace=True)

    def broken(*_a, **_k):
        raise RuntimeError(f"injected fault: the {breaks} step raised")

    if breaks == "hash":
        from kvbridge.formatter import digest

        digest.piece_digests = broken
    elif breaks == "unpack":
        from kvbridge.transceiver import staging

        staging.unpack = broken
    _serve(conn)


class FaultyRankProc(RankProc):
    """A spawned rank process (see RankProc) with `agents` registered and `breaks` installed first."""

    def __init__(self, agents: dict | None = None, breaks: str | None = None) -> None:  # noqa: D107
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve_with, args=(child, dict(agents or {}), breaks), daemon=True)
        self.proc.start()


def _gated_agent():
    from examples.custom_agent import CmaAgent
    from kvbridge.agents import TransferHandle, XferState

    class _Gated(TransferHandle):
        def __init__(self, inner: TransferHandle, gate: str) -> None:
            super().__init__(inner.num_descriptors, inner.nbytes)
            self.inner, self.gate = inner, gate

        def state(self) -> XferState:
            st = self.inner.state()
            self.error = self.error or self.inner.error
            return st if os.path.exists(self.gate) else XferState.PENDING

        def _cancel(self) -> None:
            pass  # the fault: cancel() is ignored

        def _do_release(self) -> None:
            self.inner.release()

    class GatedAgent(CmaAgent):
        def __init__(self, name: str, gate: str = "") -> None:
            super().__init__(name)
            self.gate = gate

        def _post(self, op, peer, local, remote):
            h = super()._post(op, peer, local, remote)
            return _Gated(h, self.gate) if op == "READ" and self.gate else h

    return GatedAgent


def __getattr__(name: str):  # GatedAgent is built on first use (the example agent loads only then)
    if name == "GatedAgent":
        cls = _gated_agent()
        globals()["GatedAgent"] = cls
        return cls
    raise AttributeError(name)
