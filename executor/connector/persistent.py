"""The persistent store connector: KV blocks saved to a folder outlive the executor; a later one loads them.

Instance 1 answers a prompt and saves its full blocks; instance 2 (another process, another day) gets the
same prompt, finds its blocks in the store and computes only the rest. Built from:

    keys.py        block keys chained over the prefix (blake2b), under a (model, layout) namespace
    store.py       the folder (one file per key and rank), header probes, LRU eviction under a bound
    file_agent.py  the storage agent: atomic writes, verified reads (fixed header + xxh3 checksum)

Scheduler (leader): on admission, matches the prompt's leading full blocks present for EVERY rank (at most
up to the block before the last prompt token); after allocation, lists (key, block id) loads for the next
step's metadata; when a request finishes, lists the full blocks of its computed tokens that the store lacks
and says "saving asynchronously" so the engine keeps them until every rank wrote them.

Worker (every rank): posts the step's loads and saves to its FileAgent (the agent's I/O threads do the file
work; the forward never waits for it), polls them in get_finished, reports failed loads (missing, corrupt or
truncated files, found by the agent's checks) so the engine recomputes those requests, and counts written
bytes toward the store's bound. Each rank stores its own shard under r<rank>, so TP/PP executors work.

Args (KvConnectorConfig.args): root (folder, required), max_bytes (0: unbounded), namespace_extra (text
mixed into the namespace, e.g. a weights revision), io_threads (2), fsync (True).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from ...agents.base import DescriptorList, MemoryRegion, XferState
from ...agents.file_agent import HEADER_SIZE, FileAgent, file_set, object_addrs
from ...errors import ExecutorError, ProtocolError
from .base import (
    ConnectorContext,
    ConnectorMetadata,
    ConnectorRequest,
    KvConnectorScheduler,
    KvConnectorWorker,
    SchedulerOutput,
)
from .keys import KEY_HEX, block_keys
from .store import KvStore

log = logging.getLogger(__name__)

__all__ = ["PersistentKvConnectorScheduler", "PersistentKvConnectorWorker", "PersistentMeta"]

META_VERSION = 1
CLOSE_WAIT_S = 60.0


def _store(ctx: ConnectorContext) -> KvStore:
    root = ctx.args.get("root")
    if not isinstance(root, str) or not root:
        raise ExecutorError("persistent KV connector: args['root'] (the store folder) is required")
    return KvStore(root, ctx.namespace, ctx.world_size, max_bytes=int(ctx.args.get("max_bytes", 0) or 0))


class PersistentMeta(ConnectorMetadata):
    """One step's work: per request, (keys, block ids) to load and to save."""

    def __init__(self, load: list | None = None, save: list | None = None) -> None:
        self.load: list[tuple[int, list[str], list[int]]] = load or []
        self.save: list[tuple[int, list[str], list[int]]] = save or []

    def to_wire(self) -> dict[str, Any]:
        return {"v": META_VERSION, "load": [[r, k, b] for r, k, b in self.load],
                "save": [[r, k, b] for r, k, b in self.save]}

    @classmethod
    def from_wire(cls, data: Any) -> PersistentMeta:
        if not isinstance(data, dict) or data.get("v") != META_VERSION:
            raise ProtocolError(f"persistent connector metadata: expected a map of version {META_VERSION}")
        out = []
        for part in ("load", "save"):
            items = data.get(part)
            if not isinstance(items, list):
                raise ProtocolError(f"persistent connector metadata: {part!r} is not a list")
            got = []
            for it in items:
                if not (isinstance(it, list) and len(it) == 3 and type(it[0]) is int and isinstance(it[1], list)
                        and isinstance(it[2], list) and len(it[1]) == len(it[2])):
                    raise ProtocolError(f"persistent connector metadata: bad {part} entry {it!r:.120}")
                if not all(isinstance(k, str) and len(k) == KEY_HEX for k in it[1]) or \
                        not all(type(b) is int and b >= 0 for b in it[2]):
                    raise ProtocolError(f"persistent connector metadata: {part} of request {it[0]} has a bad key "
                                        f"or block id")
                got.append((it[0], list(it[1]), list(it[2])))
            out.append(got)
        return cls(out[0], out[1])


class PersistentKvConnectorScheduler(KvConnectorScheduler):
    """Leader half of the persistent store connector."""

    def __init__(self, ctx: ConnectorContext) -> None:
        super().__init__(ctx)
        self.store = _store(ctx)
        self.tpb = ctx.tokens_per_block
        self._matched: dict[int, tuple[int, list[str]]] = {}   # rid -> (first block, keys to load)
        self._load: list[tuple[int, list[str], list[int]]] = []
        self._save: list[tuple[int, list[str], list[int]]] = []

    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        self._matched.pop(request.request_id, None)
        if num_computed_tokens % self.tpb:
            return 0, False
        prompt = request.tokens[:request.prompt_len]
        first = num_computed_tokens // self.tpb
        last = (len(prompt) - 1) // self.tpb  # blocks [first, last): the last prompt token is always computed
        if last <= first:
            return 0, False
        keys = block_keys(self.ctx.namespace, prompt[:last * self.tpb], self.tpb)[first:]
        hit = self.store.probe(keys)
        if not hit:
            return 0, False
        self._matched[request.request_id] = (first, keys[:hit])
        log.info("KV store: request %d matched %d blocks (%d tokens)", request.request_id, hit, hit * self.tpb)
        return hit * self.tpb, True

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: list[int]) -> None:
        first, keys = self._matched.pop(request.request_id, (0, []))
        if keys:
            self._load.append((request.request_id, keys, [int(b) for b in block_ids[first:first + len(keys)]]))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PersistentMeta | None:
        if not self._load and not self._save:
            return None
        meta = PersistentMeta(self._load, self._save)
        self._load, self._save = [], []
        return meta

    def request_finished(self, request: ConnectorRequest, cache_block_ids: list[int]) -> bool:
        keys = block_keys(self.ctx.namespace, request.tokens[:request.num_computed_tokens], self.tpb)
        todo = self.store.missing(keys)
        if not todo:
            return False
        self._save.append((request.request_id, [keys[i] for i in todo], [int(cache_block_ids[i]) for i in todo]))
        return True


class PersistentKvConnectorWorker(KvConnectorWorker):
    """Rank half: moves blocks between this rank's pool and its store folder through a FileAgent."""

    metadata_cls = PersistentMeta

    def __init__(self, ctx: ConnectorContext) -> None:
        super().__init__(ctx)
        self.store = _store(ctx)
        self.agent = FileAgent(f"kvstore-r{ctx.rank}", io_threads=int(ctx.args.get("io_threads", 2)),
                               fsync=bool(ctx.args.get("fsync", True)))
        lay = ctx.layout
        # this rank's writes stand for the whole key (every rank writes its shard): scale for the bound
        self._scale = float(ctx.world_size) if lay is None else \
            sum(lay.block_bytes(r) for r in range(lay.world_size)) / lay.block_bytes(ctx.rank)
        self._inflight: dict[tuple[str, int], tuple[Any, str, int]] = {}   # (op, rid) -> (handle, peer, bytes)
        self._done: dict[str, list[int]] = {"READ": [], "WRITE": []}
        self._errors: dict[int, str] = {}
        self.reg = None
        self.blocks_loaded = 0
        self.blocks_saved = 0

    def register_kv_caches(self, kv_cache_tensor) -> None:
        if self.reg is not None:
            raise ExecutorError("persistent KV connector: register_kv_caches called twice")
        if not kv_cache_tensor.is_contiguous():
            raise ExecutorError("persistent KV connector: the KV cache tensor must be contiguous")
        region = MemoryRegion.of(kv_cache_tensor)
        self.reg = self.agent.register_memory(region)
        self.kind, self.device = region.kind, region.device
        self.base = region.addr
        self.block_bytes = kv_cache_tensor.stride(0) * kv_cache_tensor.element_size()
        self.num_blocks = int(kv_cache_tensor.shape[0])
        self._cuda = kv_cache_tensor.is_cuda

    def start_load_kv(self, stream: Any = None) -> None:
        meta = self._metadata
        if meta is None:
            return
        if meta.save and self._cuda and stream is not None:
            stream.synchronize()  # the saved blocks' KV (earlier steps) is in memory before the agent reads it
        for rid, keys, blocks in meta.load:
            self._post("READ", rid, keys, blocks)
        for rid, keys, blocks in meta.save:
            self._post("WRITE", rid, keys, blocks)

    def _post(self, op: str, rid: int, keys: list[str], blocks: list[int]) -> None:
        b = np.asarray(blocks, dtype=np.int64)
        if b.size and int(b.max()) >= self.num_blocks:
            raise ExecutorError(f"persistent KV connector: request {rid} names block {int(b.max())}, the pool "
                                f"has {self.num_blocks}")
        n = len(keys)
        lengths = np.full(n, self.block_bytes, dtype=np.int64)
        local = DescriptorList(self.base + b * self.block_bytes, lengths, self.kind, self.device)
        remote = DescriptorList(object_addrs(np.arange(n)), lengths)
        peer = self.agent.connect(file_set(self.store.rank_dir(self.ctx.rank), keys, self.store.tag(self.ctx.rank)))
        try:
            h = self.agent.read(peer, local, remote) if op == "READ" else self.agent.write(peer, local, remote)
        except Exception:
            self.agent.disconnect(peer)
            raise
        self._inflight[(op, rid)] = (h, peer, n)

    def wait_for_save(self, stream: Any = None) -> None:
        pass  # every save is asynchronous: get_finished reports it

    def get_finished(self, finished_gen_req_ids: list[int],
                     started_loading_req_ids: list[int]) -> tuple[list[int], list[int]]:
        for (op, rid), (h, peer, n) in list(self._inflight.items()):
            st = h.state()
            if st is XferState.PENDING:
                continue
            del self._inflight[(op, rid)]
            if st is XferState.FAILED:
                if op == "READ":
                    self._errors[rid] = h.error or "failed"
                log.warning("KV store: %s of request %d on rank %d failed: %s", op.lower(), rid, self.ctx.rank,
                            h.error)
            elif op == "READ":
                self.blocks_loaded += n
            else:
                self.blocks_saved += n
                self.store.note_written(self._file_bytes(n))
            h.release()
            self.agent.disconnect(peer)
            self._done[op].append(rid)
        saved, loaded = self._done["WRITE"], self._done["READ"]
        self._done = {"READ": [], "WRITE": []}
        return saved, loaded

    def get_load_errors(self) -> dict[int, str]:
        out, self._errors = self._errors, {}
        return out

    def close(self) -> None:
        """Wait (bounded) for in-flight saves so a stopping instance still persists them; drop loads."""
        deadline = time.monotonic() + CLOSE_WAIT_S
        for (op, rid), (h, peer, n) in list(self._inflight.items()):
            if op == "READ":
                h.cancel()
            while h.state() is XferState.PENDING and time.monotonic() < deadline:
                time.sleep(0.005)
            st = h.state()
            if st is XferState.PENDING:
                log.warning("KV store: %s of request %d still running at close; abandoned", op.lower(), rid)
            elif op == "WRITE" and st is XferState.DONE:
                self.blocks_saved += n
                self.store.note_written(self._file_bytes(n))
            h.release()
            self.agent.disconnect(peer)
        self._inflight.clear()
        self.store.close()
        if self.reg is not None:
            self.reg.release()
        self.agent.close()

    def _file_bytes(self, nblocks: int) -> int:
        """Bytes `nblocks` of this rank's blocks add to the store, all ranks' shards counted."""
        return int(nblocks * (self.block_bytes + HEADER_SIZE) * self._scale)
