"""Spawning rank processes: the rendezvous store, the spawn context, and tearing everything down on failure.

Owns only the processes it starts: it ends them through their own handles (terminate, then kill), never by
name. Every join has a deadline.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
import time

__all__ = ["Rendezvous", "rendezvous_store", "spawn_ranks", "stop_processes"]


class Rendezvous:
    """Where an executor's ranks meet: a torch.distributed FileStore in a private folder (0700) of this user.

    Not a TCPStore: torch's listens on every interface whatever host it is given, and serves and lists its
    keys (NCCL's unique id, gloo's addresses) to anyone who reaches the port; the ranks are this host's
    processes of this user, so a file only they can open is enough. Nothing is opened until a rank opens
    `path` (`Comm`); `close()` removes the folder.
    """

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="kvb-rdv-")  # mode 0700
        self.path = os.path.join(self.folder, "store")

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def rendezvous_store() -> Rendezvous:
    """The rendezvous of a new executor's ranks (see Rendezvous); close it when the executor stops."""
    return Rendezvous()


def spawn_ranks(world: int, target, args_for_rank) -> tuple[list[mp.process.BaseProcess], list, list]:
    """Start `world` processes (spawn context) running target(rank, *args_for_rank(rank), rx, tx).

    Returns:
        (processes, to_rank connections (parent writes), from_rank connections (parent reads)).
    """
    ctx = mp.get_context("spawn")
    procs, to_rank, from_rank = [], [], []
    for rank in range(world):
        rx_child, tx_parent = ctx.Pipe(duplex=False)
        rx_parent, tx_child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=target, args=(rank, *args_for_rank(rank), rx_child, tx_child),
                        name=f"kvbridge-rank{rank}", daemon=True)
        p.start()
        rx_child.close()
        tx_child.close()
        procs.append(p)
        to_rank.append(tx_parent)
        from_rank.append(rx_parent)
    return procs, to_rank, from_rank


def stop_processes(procs: list, grace_s: float = 5.0) -> list[int | None]:
    """Wait up to `grace_s` for the processes to exit, then terminate, then kill; returns exit codes."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)
    return [p.exitcode for p in procs]
