"""PersistentKvCacheConnector: TensorRT-LLM's example connector (a folder of KV blocks keyed by their tokens),
written for kvbridge from its description, without pickle: each block is a safetensors file.

    ExecutorConfig(kv_connector_config=kv_connector_config(
        "kvbridge.executor.connector.trtllm_example", "PersistentKvCacheConnectorLeader",
        "PersistentKvCacheConnectorWorker", root="/data/kv"))   # or CONNECTOR_CACHE_FOLDER=/data/kv, upstream's

Owns the folder's naming and the leader/worker bookkeeping. A full block of a finished request is saved as
`<root>/<key>.r<rank>.safetensors` (one file per rank's shard; key: sha256 chained over the namespace and
every token up to the block's end, so a block matches only after the same prefix). An admitted request loads
the longest run of leading blocks that every rank has, short of its last prompt token, synchronously before
its prefill. A file of the wrong shape or dtype, or unreadable, fails that load (get_load_errors): kvbridge's
engine then computes the prompt. Saves are asynchronous in upstream's sense: request_finished answers True and
the blocks stay held until every worker's get_finished reported the save. Never evicts (upstream's example
does not either): bound the folder yourself, or use kvbridge's own persistent connector.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ...errors import ExecutorError
from .trtllm_api import KvCacheConnectorScheduler, KvCacheConnectorWorker, LlmArgs, SchedulerOutput, mpi_rank

log = logging.getLogger(__name__)

__all__ = ["PersistentKvCacheConnectorLeader", "PersistentKvCacheConnectorMetadata",
           "PersistentKvCacheConnectorWorker"]


@dataclass
class PersistentKvCacheConnectorMetadata:
    """One step's work: loads [(request id, block id, key)], saves [(request id, block id, key)]."""

    load: list = field(default_factory=list)
    save: list = field(default_factory=list)


def _root(args: LlmArgs) -> str:
    root = args.connector_args.get("root") or os.environ.get("CONNECTOR_CACHE_FOLDER")
    if not root:
        raise ExecutorError("PersistentKvCacheConnector needs a folder: args root=... or "
                            "CONNECTOR_CACHE_FOLDER")
    os.makedirs(root, exist_ok=True)
    return str(root)


def block_keys(namespace: str, tokens: list[int], tokens_per_block: int) -> list[str]:
    """Key of every full block of `tokens`, chained over the prefix."""
    h = hashlib.sha256(namespace.encode())
    out = []
    for i in range(len(tokens) // tokens_per_block):
        block = tokens[i * tokens_per_block:(i + 1) * tokens_per_block]
        h.update(np.asarray(block, dtype=np.int64).tobytes())
        out.append(h.copy().hexdigest()[:40])
    return out


class PersistentKvCacheConnectorLeader(KvCacheConnectorScheduler):
    """Decides loads (on admission) and saves (on finish)."""

    def __init__(self, llm_args: LlmArgs) -> None:
        super().__init__(llm_args)
        self.root = _root(llm_args)
        self.tpb = llm_args.kv_cache_config.tokens_per_block
        self.world = llm_args.tensor_parallel_size * llm_args.pipeline_parallel_size
        self.ns = llm_args.kvbridge_namespace or (f"{llm_args.model}|tpb={self.tpb}|tp="
                                                  f"{llm_args.tensor_parallel_size}|pp={llm_args.pipeline_parallel_size}")
        self._matched: dict[int, list[str]] = {}
        self._meta = PersistentKvCacheConnectorMetadata()

    def _stored(self, key: str) -> bool:
        return all(os.path.isfile(os.path.join(self.root, f"{key}.r{r}.safetensors"))
                   for r in range(self.world))

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        prompt = list(request.get_tokens(0))[:request.prompt_len]
        keys = block_keys(self.ns, prompt[:len(prompt) - 1], self.tpb)  # the last prompt token is computed
        first = num_computed_tokens // self.tpb
        hits = []
        for k in keys[first:]:
            if not self._stored(k):
                break
            hits.append(k)
        if hits:
            self._matched[request.request_id] = hits
        return len(hits) * self.tpb, False

    def update_state_after_alloc(self, request, block_ids: list[int]) -> None:
        keys = self._matched.pop(request.request_id, [])
        self._meta.load += [(request.request_id, int(b), k) for b, k in zip(block_ids, keys)]

    def build_connector_meta(self, scheduler_output: SchedulerOutput
                             ) -> PersistentKvCacheConnectorMetadata | None:
        if not self._meta.load and not self._meta.save:
            return None
        meta, self._meta = self._meta, PersistentKvCacheConnectorMetadata()
        return meta

    def request_finished(self, request, cache_block_ids: list[int]) -> bool:
        n = int(getattr(request, "num_computed_tokens", len(request.get_tokens(0)) - 1))
        keys = block_keys(self.ns, list(request.get_tokens(0))[:n], self.tpb)
        todo = [(request.request_id, int(b), k) for b, k in zip(cache_block_ids, keys) if not self._stored(k)]
        self._meta.save += todo
        return bool(todo)


class PersistentKvCacheConnectorWorker(KvCacheConnectorWorker):
    """Copies blocks between this rank's pool and the folder."""

    def __init__(self, llm_args: LlmArgs) -> None:
        super().__init__(llm_args)
        self.root = _root(llm_args)
        self.rank = mpi_rank()
        self.pool: torch.Tensor | None = None
        self._saved: set[int] = set()    # saves done, not yet returned by get_finished
        self._pending: set[int] = set()  # handed to get_finished as saving, not yet returned
        self._errors: dict[int, str] = {}

    def _path(self, key: str) -> str:
        return os.path.join(self.root, f"{key}.r{self.rank}.safetensors")

    def register_kv_caches(self, kv_cache_tensor: torch.Tensor) -> None:
        self.pool = kv_cache_tensor

    def start_load_kv(self, stream) -> None:
        meta = self.get_connector_meta()
        for rid, block, key in (meta.load if meta else []):
            if rid in self._errors:
                continue
            try:
                t = load_file(self._path(key)).get("kv")
                want = self.pool[block]
                if t is None or t.shape != want.shape or t.dtype != want.dtype:
                    got = None if t is None else (tuple(t.shape), t.dtype)
                    raise ValueError(f"holds {got}, the pool's block is {(tuple(want.shape), want.dtype)}")
                want.copy_(t)
            except Exception as e:  # noqa: BLE001 - any unreadable or mismatched file fails this load
                self._errors[rid] = f"block file {key}.r{self.rank}: {type(e).__name__}: {e}"

    def wait_for_layer_load(self, layer_idx: int, stream) -> None:
        """Loads are whole blocks, done in start_load_kv."""

    def save_kv_layer(self, layer_idx: int, stream) -> None:
        """Saves are whole blocks of finished requests, done in wait_for_save."""

    def wait_for_save(self, stream) -> None:
        meta = self.get_connector_meta()
        for rid, block, key in (meta.save if meta else []):
            path = self._path(key)
            tmp = f"{path}.{os.getpid()}.tmp"
            save_file({"kv": self.pool[block].contiguous().cpu()}, tmp)
            os.replace(tmp, path)  # readers see a whole file or none
            self._saved.add(rid)

    def get_finished(self, finished_gen_req_ids: list[int],
                     started_loading_req_ids: list[int]) -> tuple[list[int], list[int]]:
        self._pending.update(finished_gen_req_ids)
        done = sorted(self._pending & self._saved)
        self._pending -= set(done)
        self._saved -= set(done)
        return done, []

    def get_load_errors(self) -> dict[int, str]:
        errs, self._errors = self._errors, {}
        return errs
