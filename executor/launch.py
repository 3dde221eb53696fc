"""Spawning rank processes: the rendezvous store, the spawn context, and tearing everything down on failure.

Owns only the processes it starts: it ends them through their own handles (terminate, then kill), never by
name. Every join has a deadline.
"""

from __future__ import annotations

import multiprocessing as mp
import time

__all__ = ["rendezvous_store", "spawn_ranks", "stop_processes"]


def rendezvous_store(timeout_s: float, host: str = "127.0.0.1"):
    """A torch.distributed TCPStore hosted by this process on a port the kernel picks (bound, so no race).

    The ranks connect to it as clients (`Comm`, given its port); it lives as long as the returned object.
    Picking a free port first and letting rank 0 bind it later lost the port now and then to another process
    (EADDRINUSE at init_process_group).
    """
    from datetime import timedelta
    from torch.distributed import TCPStore
    return TCPStore(host, 0, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)


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
