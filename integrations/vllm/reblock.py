"""Pulls from a prefill engine of another block size: whole blocks into a staging pool, repacked into vLLM's.

A CPU-attention cache packs each (block, head) region its own way (packing.py), so a block of 32 tokens is
not the first half of a block of 64. kvbridge still moves whole regions (the fast path: large fragments, the
formatter's TP remap) — into a staging pool shaped like this worker's cache but with the PREFILL's block size,
read by a Receiver of its own — and then, on this worker, unpacks the request's staged regions to token rows
and packs them into vLLM's blocks (`_repack`). Exact for any two block sizes the kernel supports, whatever the
TP split, as long as both engines pack alike (the prefill's packing digest must equal this engine's probe of
that block size: checked before anything is read).

One `_Stage` per prefill block size met, created on first use; staging blocks are handed out per request
and come back when its pull has settled (read, failed or cancelled). A request that does not fit waits in a
queue with the transfer deadline; the staging pool holds at least the model's longest request.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from ...formatter.layout import KVLayout, KVShape
from ...transceiver.cache_transceiver import agent_defaults
from ...transceiver.config import TransceiverConfig
from ...transceiver.params import DisaggParams
from ...transceiver.pool import LocalPool
from ...transceiver.receiver import Receiver
from .layout import CachePool, moved_tokens
from .packing import ELEMENT_INT, Packing, pack, unpack

log = logging.getLogger(__name__)

__all__ = ["Reblocker", "Settled"]


@dataclass(frozen=True)
class Settled:
    """One reblocked pull's end: ok, bytes read, milliseconds, error."""

    key: str
    ok: bool
    nbytes: int = 0
    ms: float = 0.0
    error: str = ""
    read_ms: float = 0.0
    transport_ms: float = 0.0  # the reads on NIXL's own clock, where the agent keeps its telemetry


@dataclass
class _Job:
    key: str
    disagg: DisaggParams
    dest: list[int]
    num_tokens: int
    from_token: int
    deadline: float
    staged: list[int] = field(default_factory=list)
    started: float = 0.0


class _Stage:
    """A staging pool with the prefill's block size, its Receiver and its free blocks."""

    def __init__(self, cache: CachePool, tokens_per_block: int, tokens: int, config: TransceiverConfig,
                 instance: str) -> None:
        s, lay = cache.layout.shape, cache.layout
        shape = KVShape(s.num_layers, s.num_kv_heads, s.head_dim, s.dtype, tokens_per_block, s.mla)
        self.layout = KVLayout(shape, lay.split, lay.order)
        self.tokens_per_block = tokens_per_block
        self.num_blocks = max(1, -(-int(tokens) // tokens_per_block))
        like = cache.buffers[0]
        dims = (self.num_blocks,) + tuple(like.shape[1:2]) + (tokens_per_block,) + tuple(like.shape[3:])
        self.buffers = tuple(torch.zeros(dims, dtype=like.dtype, device=like.device) for _ in cache.buffers)
        # the agents' defaults of every transceiver, as the worker's own pool has them
        self.pool = LocalPool(self.layout, cache.rank, list(self.buffers), self.num_blocks, agent_defaults(config))
        try:
            self.receiver = Receiver(self.pool, config, f"{instance}-b{tokens_per_block}")
        except BaseException:
            self.pool.close()
            raise
        self.free: deque[int] = deque(range(self.num_blocks))

    def close(self) -> None:
        self.receiver.close()
        self.pool.close()


class Reblocker:
    """Reblocked pulls of one vLLM worker.

    Args:
        cache: this worker's KV tensors (the repack's destination).
        config / instance: as the worker's own Receiver's.
        packing_of: this engine's kernel packing for a block size (packing.probe through vLLM's store op).
        staging_tokens: tokens each staging pool holds (at least the model's longest request).
    """

    def __init__(self, cache: CachePool, config: TransceiverConfig, instance: str,
                 packing_of: Callable[[int], Packing], staging_tokens: int) -> None:
        self.cache, self.config, self.instance = cache, config, instance
        self.packing_of, self.staging_tokens = packing_of, int(staging_tokens)
        self._stages: dict[int, _Stage] = {}
        self._queue: deque[tuple[int, _Job]] = deque()
        self._running: dict[int, tuple[int, _Job]] = {}  # receiver request id -> (tokens per block, job)
        self._by_key: dict[str, int] = {}
        self._next = 1
        self._settled: list[Settled] = []

    def check(self, ctx_tokens_per_block: int, ctx_packing: str) -> str:
        """'' when a pull from a prefill of that block size and packing digest can be exact, else why not."""
        mine = self.packing_of(ctx_tokens_per_block)
        if ctx_packing != mine.digest:
            return (f"the prefill's attention kernel packs its {ctx_tokens_per_block}-token blocks as "
                    f"{ctx_packing or 'unknown'}, this engine's would be {mine.digest}: the KV cannot be "
                    f"repacked exactly (same vLLM version and CPU ISA on both sides?)")
        return ""

    def submit(self, key: str, disagg: DisaggParams, dest: list[int], num_tokens: int, from_token: int) -> None:
        job = _Job(key, disagg, list(dest), int(num_tokens), int(from_token),
                   time.monotonic() + float(self.config.transfer_timeout_s))
        tpb = disagg.ctx_layout.shape.tokens_per_block
        if tpb not in self._stages:
            self._stages[tpb] = _Stage(self.cache, tpb, max(self.staging_tokens, num_tokens), self.config,
                                       self.instance)
        self._queue.append((tpb, job))
        self._start_queued()

    def cancel(self, key: str) -> None:
        rid = self._by_key.get(key)
        if rid is not None and rid in self._running:
            self._stages[self._running[rid][0]].receiver.cancel(rid)
            return
        for i, (_, job) in enumerate(self._queue):
            if job.key == key:
                del self._queue[i]
                self._settled.append(Settled(key, False, error="cancelled before its pull started"))
                return

    def _start_queued(self) -> None:
        now, waiting = time.monotonic(), deque()
        while self._queue:
            tpb, job = self._queue.popleft()
            st = self._stages[tpb]
            need = -(-job.num_tokens // tpb)
            if need > st.num_blocks:
                self._settled.append(Settled(job.key, False, error=f"the request's {job.num_tokens} tokens exceed "
                                             f"the {st.num_blocks * tpb}-token staging pool (staging_tokens)"))
            elif len(st.free) >= need:
                self._start(st, job, [st.free.popleft() for _ in range(need)])
            elif now > job.deadline:
                self._settled.append(Settled(job.key, False, error="waited for staging blocks past the "
                                             "transfer deadline"))
            else:
                waiting.append((tpb, job))
        self._queue = waiting

    def _start(self, st: _Stage, job: _Job, staged: list[int]) -> None:
        rid, self._next = self._next, self._next + 1
        job.staged, job.started = staged, time.monotonic()
        tpb, dst_T = st.tokens_per_block, self.cache.layout.shape.tokens_per_block
        start = job.from_token // dst_T * dst_T // tpb * tpb  # the first staged token the repack writes from
        try:
            st.receiver.submit(rid, job.disagg, staged, moved_tokens(job.num_tokens, st.layout),
                               max(0.001, job.deadline - time.monotonic()), start)
        except Exception as e:  # noqa: BLE001 - this request fails, the worker keeps serving
            st.free.extend(staged)
            self._settled.append(Settled(job.key, False, error=f"{type(e).__name__}: {e}"))
            return
        self._running[rid] = (tpb, job)
        self._by_key[job.key] = rid

    def poll(self) -> list[Settled]:
        """Pulls settled since the last call; a read one is repacked into vLLM's blocks before it is reported."""
        for st in self._stages.values():
            for r in st.receiver.poll_finished():
                entry = self._running.pop(r.request_id, None)
                if entry is None:
                    continue
                job = entry[1]
                self._by_key.pop(job.key, None)
                if r.ok:
                    try:
                        self._repack(st, job)
                        self._settled.append(Settled(job.key, True, r.nbytes,
                                                     (time.monotonic() - job.started) * 1e3,
                                                     read_ms=float(r.timings_ms.get("xfer", 0.0)),
                                                     transport_ms=float(r.timings_ms.get("transport", 0.0))))
                    except Exception as e:  # noqa: BLE001
                        self._settled.append(Settled(job.key, False, error=f"repacking failed: {e}"))
                else:
                    self._settled.append(Settled(job.key, False, error=f"{r.error_type}: {r.error}"))
                st.free.extend(job.staged)
        self._start_queued()
        out, self._settled = self._settled, []
        return out

    def _repack(self, st: _Stage, job: _Job) -> None:
        """Staged regions -> token rows -> this engine's blocks, tokens [from_token, num_tokens) (block-aligned)."""
        src_p = self.packing_of(st.tokens_per_block)
        lay = self.cache.layout
        dst_T = lay.shape.tokens_per_block
        dst_p = self.packing_of(dst_T)
        first = job.from_token // dst_T
        last = -(-job.num_tokens // dst_T)
        if last <= first:
            return
        src_ids = torch.as_tensor(job.staged, dtype=torch.int64)
        dst_ids = torch.as_tensor(job.dest[first:last], dtype=torch.int64)
        lo, hi = first * dst_T, last * dst_T
        have = len(job.staged) * st.tokens_per_block
        for sbuf, dbuf in zip(st.buffers, self.cache.buffers):
            itype = ELEMENT_INT[sbuf.element_size()]
            H, D = sbuf.shape[1], src_p.head_dim
            src = sbuf.view(itype).view(sbuf.shape[0], H, 2, -1).index_select(0, src_ids)
            rows = unpack(src, src_p)  # [nb, H, 2, Ts, D]
            rows = rows.permute(1, 2, 0, 3, 4).reshape(H, 2, have, D)
            want = torch.zeros(H, 2, hi - lo, D, dtype=itype)
            end = min(hi, have)
            want[:, :, : end - lo] = rows[:, :, lo:end]
            blocks = want.view(H, 2, last - first, dst_T, D).permute(2, 0, 1, 3, 4)
            dview = dbuf.view(itype).view(dbuf.shape[0], H, 2, -1)
            dview.index_copy_(0, dst_ids, pack(blocks, dst_p))

    @property
    def busy(self) -> bool:
        return bool(self._running or self._queue)

    def close(self) -> None:
        for st in self._stages.values():
            st.close()
        self._stages.clear()
