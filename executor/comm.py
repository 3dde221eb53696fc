"""The ranks' torch.distributed plumbing: process groups, TP all-reduce, PP send/recv, step-plan broadcast.

Owns group construction (one world group on the device backend, gloo on CPU / NCCL on GPU; a gloo group
for control; one TP group per pipeline stage) and every collective the executor uses. Every wait is
bounded (`Work.wait(timeout)`, and the groups' own timeout). Step plans travel as msgpack bytes in a uint8
tensor, decoded with the strict codec: never pickle, never broadcast_object_list.
"""

from __future__ import annotations

import datetime as _dt
import os

import torch
import torch.distributed as dist

from .. import codec
from ..errors import ExecutorError
from ..netaddr import loopback_interfaces
from ..formatter.layout import KVLayout

__all__ = ["Comm"]

MAX_PLAN_BYTES = 64 << 20


class Comm:
    """Process groups of one rank.

    Args:
        layout: the executor's layout (TP/PP sizes; rank = pp_rank * tp + tp_rank).
        rank: this rank.
        store: the path of the ranks' rendezvous FileStore, in the parent's private folder
            (launch.Rendezvous).
        device: the rank's device; "cuda:*" selects NCCL for tensors, else gloo.
        timeout_s: bound on init and on every collective wait.
    """

    def __init__(self, layout: KVLayout, rank: int, store: str, device: torch.device,
                 timeout_s: float = 60.0) -> None:
        self.layout, self.rank, self.device = layout, rank, device
        self.world = layout.world_size
        self.tp, self.pp = layout.split.tp, layout.split.pp
        self.tp_rank, self.pp_rank = layout.coords(rank)
        self.timeout = _dt.timedelta(seconds=timeout_s)
        backend = "nccl" if device.type == "cuda" else "gloo"
        self.enabled = self.world > 1
        if not self.enabled:
            return
        # the ranks are this host's: gloo's pair sockets on loopback (unless the user chose an interface)
        loopback_interfaces(os.environ, ("GLOO_SOCKET_IFNAME",))
        file_store = dist.FileStore(store, -1)  # -1: the parent removes it (launch.Rendezvous)
        dist.init_process_group(backend, store=file_store, rank=rank, world_size=self.world,
                                timeout=self.timeout)
        self.cpu_group = dist.new_group(backend="gloo", timeout=self.timeout) if backend != "gloo" \
            else dist.group.WORLD
        self.tp_group = None
        for s in range(self.pp):  # every rank creates every group, in the same order
            g = dist.new_group([layout.rank_of(t, s) for t in range(self.tp)], timeout=self.timeout)
            if s == self.pp_rank:
                self.tp_group = g

    def close(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()

    # --- helpers -------------------------------------------------------------------------------------
    def _wait(self, work, what: str) -> None:
        try:
            ok = work.wait(self.timeout)
        except RuntimeError as e:
            raise ExecutorError(f"rank {self.rank}: {what} failed or timed out after "
                                f"{self.timeout.total_seconds():.0f}s ({e})") from None
        if ok is False:
            raise ExecutorError(f"rank {self.rank}: {what} timed out after "
                                f"{self.timeout.total_seconds():.0f}s")

    # --- TP -------------------------------------------------------------------------------------------
    def all_reduce_tp(self, x: torch.Tensor) -> None:
        """Sum `x` over this stage's TP group, in place."""
        if self.tp == 1:
            return
        self._wait(dist.all_reduce(x, group=self.tp_group, async_op=True), "TP all-reduce")

    # --- PP -------------------------------------------------------------------------------------------
    def send_next_stage(self, x: torch.Tensor) -> None:
        """Send hidden states to the same TP rank of the next stage."""
        dst = self.layout.rank_of(self.tp_rank, self.pp_rank + 1)
        self._wait(dist.isend(x.contiguous(), dst), f"PP send to rank {dst}")

    def recv_prev_stage(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        src = self.layout.rank_of(self.tp_rank, self.pp_rank - 1)
        x = torch.empty(shape, dtype=dtype, device=self.device)
        self._wait(dist.irecv(x, src), f"PP recv from rank {src}")
        return x

    # --- control (CPU group) ---------------------------------------------------------------------------
    def broadcast_plan(self, payload: bytes | None) -> dict:
        """Rank 0 sends its step plan (msgpack bytes); every rank returns the decoded plan."""
        if self.rank == 0:
            n = torch.tensor([len(payload)], dtype=torch.int64)
        else:
            n = torch.zeros(1, dtype=torch.int64)
        if self.enabled:
            self._wait(dist.broadcast(n, 0, group=self.cpu_group, async_op=True), "plan length broadcast")
        size = int(n.item())
        if not 0 < size <= MAX_PLAN_BYTES:
            raise ExecutorError(f"rank {self.rank}: step plan of {size} bytes is outside 1..{MAX_PLAN_BYTES}")
        if self.rank == 0:
            buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        else:
            buf = torch.empty(size, dtype=torch.uint8)
        if self.enabled:
            self._wait(dist.broadcast(buf, 0, group=self.cpu_group, async_op=True), "plan broadcast")
        return codec.unpack(buf.numpy().tobytes(), max_bytes=MAX_PLAN_BYTES, what="step plan")

    def send_tokens_to_leader(self, tokens: torch.Tensor) -> None:
        self._wait(dist.isend(tokens.to(torch.int64).cpu().contiguous(), 0, group=self.cpu_group),
                   "token send to the leader")

    def recv_tokens_from(self, src: int, n: int) -> torch.Tensor:
        t = torch.empty(n, dtype=torch.int64)
        self._wait(dist.irecv(t, src, group=self.cpu_group), f"token recv from rank {src}")
        return t

    def all_gather_msgpack(self, obj, what: str) -> list:
        """Every rank's `obj` (plain msgpack-able data), in rank order, over the control group; decoded with
        the strict codec (bounded), never pickle. Called by every rank at the same point of its loop."""
        data = codec.pack(obj)
        if not self.enabled:
            return [codec.unpack(data, what=f"rank 0 {what}")]
        n = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        self._wait(dist.all_gather(sizes, n, group=self.cpu_group, async_op=True), f"{what} sizes")
        width = int(max(s.item() for s in sizes))
        buf = torch.zeros(width, dtype=torch.uint8)
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        bufs = [torch.zeros(width, dtype=torch.uint8) for _ in range(self.world)]
        self._wait(dist.all_gather(bufs, buf, group=self.cpu_group, async_op=True), what)
        return [codec.unpack(b[:int(s.item())].numpy().tobytes(), what=f"rank {r} {what}")
                for r, (b, s) in enumerate(zip(bufs, sizes))]

