"""The worker half's seat in one rank process: the hooks in step order, and this rank's report.

Built by the rank (worker.py) once its pool and model exist; the model calls the layer hooks. Per plan:

    begin_step(plan.conn)      bind_connector_meta(decoded metadata), start_load_kv     after the plan's ops
    wait_for_layer_load(i) / save_kv_layer(i)                                          around local layer i
    end_step()                 wait_for_save, then the metadata is cleared                after the forward
    exchange(comm)             get_finished(newly saving, newly loading) + get_load_errors, all-gathered

Never frees or allocates blocks (the plan does, on every rank alike). A worker returning an id it was never
given, or twice, is logged and ignored: the leader only acts on ids every rank reported.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ...errors import ExecutorError, ProtocolError
from ...formatter.layout import KVLayout
from .base import KvConnectorWorker
from .factory import check_spec, load_class, make_context
from .wire import ConnReport, ConnSection, exchange

log = logging.getLogger(__name__)

__all__ = ["ConnectorRank"]


class ConnectorRank:
    """One rank's connector worker, driven by the rank's step loop.

    Args:
        cfg: the executor config (its "kv_connector" spec, model, num_blocks).
        rank, layout, pool, device: this rank, the executor's layout, the rank's pool tensor and device.
        model_config: the model's config dict (part of the store namespace).
    """

    def __init__(self, cfg: dict, rank: int, layout: KVLayout, pool: torch.Tensor, device: torch.device,
                 model_config: dict) -> None:
        spec = check_spec(cfg["kv_connector"])
        self.rank = rank
        self.worker: KvConnectorWorker = load_class(spec, "worker")(
            make_context(spec, cfg, layout, rank, device, model_config))
        self.worker.register_kv_caches(pool)
        self._cuda = device.type == "cuda"
        self._device = device
        self._new = {"saving": [], "loading": []}      # announced in plans, not yet passed to get_finished
        self._open = {"saving": set(), "loading": set()}  # passed, not yet returned
        self._active = False

    def _stream(self) -> Any:
        return torch.cuda.current_stream(self._device) if self._cuda else None

    def begin_step(self, sec: ConnSection) -> None:
        meta_wire, saving, loading = sec.meta, list(sec.saving), list(sec.loading)
        meta = None
        if meta_wire is not None:
            cls = self.worker.metadata_cls
            if cls is None:
                raise ExecutorError(f"rank {self.rank}: the connector worker got metadata but declares no "
                                    f"metadata_cls to decode it")
            try:
                meta = cls.from_wire(meta_wire)
            except ProtocolError as e:
                raise ExecutorError(f"rank {self.rank}: connector metadata: {e}") from None
        self._new["saving"] += saving
        self._new["loading"] += loading
        self.worker.bind_connector_meta(meta)
        self._active = True
        self.worker.start_load_kv(self._stream())

    def wait_for_layer_load(self, layer_idx: int) -> None:
        if self._active:
            self.worker.wait_for_layer_load(layer_idx, self._stream())

    def save_kv_layer(self, layer_idx: int) -> None:
        if self._active:
            self.worker.save_kv_layer(layer_idx, self._stream())

    def end_step(self) -> None:
        if self._active:
            self.worker.wait_for_save(self._stream())
            self.worker._clear_connector_meta()
            self._active = False

    def report(self) -> ConnReport:
        saving, loading = self._new["saving"], self._new["loading"]
        self._new = {"saving": [], "loading": []}
        self._open["saving"].update(saving)
        self._open["loading"].update(loading)
        saved, loaded = self.worker.get_finished(saving, loading)
        errors = self.worker.get_load_errors()
        return ConnReport(tuple(self._take("saving", saved)), tuple(self._take("loading", loaded)),
                          tuple((int(r), str(w)) for r, w in errors.items()))

    def _take(self, kind: str, ids) -> list[int]:
        out = []
        for rid in ids:
            if rid in self._open[kind]:
                self._open[kind].discard(rid)
                out.append(int(rid))
            else:
                log.warning("rank %d: connector get_finished returned %s request %r, which is not in flight; "
                            "ignored", self.rank, kind, rid)
        return out

    def exchange(self, comm) -> list[dict]:
        """This rank's report, all-gathered (every rank calls it after every plan)."""
        return exchange(comm, self.report())

    def close(self) -> None:
        self.worker.close()
