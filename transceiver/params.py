"""Disaggregation parameters: what a context executor hands back so a generation executor can pull the KV.

Travels from the context worker to the router to the generation worker (JSON over HTTP), so `from_dict`
validates every field and raises ProtocolError naming the bad one. Owns only this value and its JSON form;
never opens a connection and never prints the secret (it stays out of repr).
"""

from __future__ import annotations

import marshal
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ProtocolError
from ..formatter.layout import KVLayout

__all__ = ["DisaggParams"]

_MAX_ENDPOINTS = 4096
_MAX_ID = 1 << 63
_MAX_SECRET = 64  # bytes
_MAX_BLOCK_IDS = 1 << 21  # as many as one Blocks message may carry


@dataclass(frozen=True, slots=True)  # slots: made per request, and quicker to make
class DisaggParams:
    """Where a finished context request's KV lives.

    ctx_request_id: the context executor's id of the request.
    ctx_instance: the context executor's instance id (changes when it restarts).
    endpoints: control endpoint of every context rank, in rank order.
    ctx_layout: the context executor's KVLayout.
    secret: the request's secret (transceiver/handles.py); every Fetch carries it, and a context rank treats a
        wrong or missing one exactly like an unknown request. Travels as hex; never printed.
    ctx_block_ids: optional, the request's block ids on the context side (the same on every context rank).
        Given, a generation rank reads ahead: it posts its reads together with its Fetch instead of waiting
        for the Blocks answer (one round trip fewer). A context rank accepts a read-ahead only for a request
        it published complete (every layer final) under a secret it made itself (`respond_and_send_async`
        without one), so holding the secret proves the reads started after the publish; otherwise the pull
        fails with ReadAheadRefused. Leave it out for streamed requests and caller-chosen secrets.
    """

    ctx_request_id: int
    ctx_instance: str
    endpoints: tuple[str, ...]
    ctx_layout: KVLayout
    secret: bytes = field(default=b"", repr=False)
    ctx_block_ids: tuple[int, ...] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.secret, bytes) or len(self.secret) > _MAX_SECRET:
            raise ProtocolError(f"disaggregated params: secret must be at most {_MAX_SECRET} bytes")
        if len(self.endpoints) != self.ctx_layout.world_size:
            raise ProtocolError(f"disaggregated params: {len(self.endpoints)} endpoints for a context executor of "
                                f"{self.ctx_layout.world_size} ranks")
        if self.ctx_block_ids is not None:
            object.__setattr__(self, "ctx_block_ids", _block_ids(self.ctx_block_ids))

    @property
    def layout_fingerprint(self) -> str:
        return _fingerprint(self.ctx_layout)

    def to_dict(self) -> dict[str, Any]:
        d = {"ctx_request_id": self.ctx_request_id, "ctx_instance": self.ctx_instance,
             "endpoints": list(self.endpoints), "ctx_layout": self.ctx_layout.to_wire(),
             "layout_fingerprint": self.layout_fingerprint, "secret": self.secret.hex()}
        if self.ctx_block_ids is not None:
            d["ctx_block_ids"] = list(self.ctx_block_ids)
        return d

    @classmethod
    def from_dict(cls, d: Any) -> "DisaggParams":
        if not isinstance(d, dict):
            raise ProtocolError("disaggregated params: expected an object")
        for k, t in (("ctx_request_id", int), ("ctx_instance", str), ("endpoints", list), ("ctx_layout", dict)):
            if k not in d:
                raise ProtocolError(f"disaggregated params: missing field {k!r}")
            if not isinstance(d[k], t) or isinstance(d[k], bool):
                raise ProtocolError(f"disaggregated params: field {k!r} should be {t.__name__}")
        eps = d["endpoints"]
        if not eps or len(eps) > _MAX_ENDPOINTS or not all(
                isinstance(e, str) and e.startswith("tcp://") and len(e) < 256 for e in eps):
            raise ProtocolError("disaggregated params: endpoints must be 1..4096 'tcp://host:port' strings")
        layout, layout_fp = _layout(d["ctx_layout"])
        fp = d.get("layout_fingerprint")
        if fp is not None and fp != layout_fp:
            raise ProtocolError(f"disaggregated params: layout_fingerprint {fp!r} does not match the layout given "
                                f"({layout_fp})")
        rid = d["ctx_request_id"]
        if not 0 <= rid < _MAX_ID:
            raise ProtocolError("disaggregated params: ctx_request_id must be in 0..2**63-1")
        return cls(rid, d["ctx_instance"], tuple(eps), layout, _secret(d.get("secret", "")),
                   d.get("ctx_block_ids"))  # validated by __post_init__


# Every request of a context executor carries the same layout: it is parsed, validated and hashed once.
_CACHE_MAX = 256
_layouts: dict[bytes, tuple[KVLayout, str]] = {}  # marshal bytes of a wire layout -> (its layout, fingerprint)
_fingerprints: dict[KVLayout, str] = {}


def _layout(w: Any) -> tuple[KVLayout, str]:
    """(KVLayout.from_wire(w), its fingerprint), remembered by w's marshal bytes: exact types (true is not 1,
    1.0 is not 1, no subclass passes for its base) and key order kept apart, ~5x cheaper than canonical JSON; a
    wire layout with the same keys in another order is parsed once more, never confused."""
    try:
        key = marshal.dumps(w, 2)  # version 2: no back-references, so the bytes depend on the value alone
    except ValueError:  # not plain data: from_wire names what is wrong
        layout = KVLayout.from_wire(w)
        return layout, _fingerprint(layout)
    hit = _layouts.get(key)
    if hit is None:
        layout = KVLayout.from_wire(w)
        hit = (layout, _fingerprint(layout))
        if len(_layouts) >= _CACHE_MAX:
            _layouts.clear()
        _layouts[key] = hit
    return hit


def _fingerprint(layout: KVLayout) -> str:
    fp = _fingerprints.get(layout)
    if fp is None:
        if len(_fingerprints) >= _CACHE_MAX:
            _fingerprints.clear()
        fp = _fingerprints[layout] = layout.fingerprint()
    return fp


def _block_ids(v: Any) -> tuple[int, ...]:
    """Validated block ids: a list or tuple of ints (JSON), or a 1-d integer numpy array (in-process)."""
    if isinstance(v, np.ndarray) and v.ndim == 1 and v.dtype.kind in "iu":
        v = v.tolist()
    if isinstance(v, (tuple, list)) and len(v) <= _MAX_BLOCK_IDS and all(
            isinstance(x, (int, np.integer)) and not isinstance(x, bool) and 0 <= x < _MAX_ID for x in v):
        return tuple(int(x) for x in v)
    raise ProtocolError(f"disaggregated params: ctx_block_ids must be a list of at most {_MAX_BLOCK_IDS} "
                        f"integers in 0..2**63-1")


def _secret(v: Any) -> bytes:
    if not isinstance(v, str) or len(v) > 2 * _MAX_SECRET or len(v) % 2:
        raise ProtocolError(f"disaggregated params: secret must be a hex string of at most {2 * _MAX_SECRET} digits")
    try:
        return bytes.fromhex(v)
    except ValueError:
        raise ProtocolError("disaggregated params: secret is not hex") from None
