"""A worker's registration: what the router learns about a worker from the registry, signed.

    {"v": RECORD_VERSION, "record": {<WorkerRecord fields>}, "sig": hex HMAC-SHA256(key, canonical record)}

The key is derived from the deployment's internal token and the cluster name (`registry_key`), so only a
process that holds the token can write a record the router accepts: a store without authentication (an etcd
anyone on the network can write) cannot be used to point the router at a host of the attacker's choosing.
`decode` is the one reader of registry values; it checks the version, the signature (constant time), every
field's type, and that the record lives under its own key, and raises RegistrationRefused naming what was
wrong. The token itself never goes into the store or over the wire here.

Bump RECORD_VERSION when a field changes meaning or a required field is added.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import asdict, dataclass
from typing import Any

from ...errors import KvBridgeError

__all__ = ["RECORD_VERSION", "WorkerRecord", "RegistrationRefused", "registry_key", "access_proof", "encode",
           "decode", "worker_key", "workers_prefix"]

RECORD_VERSION = 1
MAX_VALUE_BYTES = 64 << 10
ROLES = ("context", "generation")


class RegistrationRefused(KvBridgeError):
    """A registry value the router will not route to; `reason` is a short tag (forged, stale_incarnation,
    duplicate_worker_id, malformed, wrong_cluster, wrong_model), the message says what was wrong."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclass(frozen=True)
class WorkerRecord:
    """One worker incarnation as it registered.

    worker_id: the name it routes by (unique in the cluster); incarnation: changes whenever the process
    restarts (its instance id); started_ns: when that incarnation started (a later one replaces an earlier
    one, never the reverse).
    """

    cluster: str
    worker_id: str
    role: str
    url: str
    model: str
    incarnation: str
    started_ns: int
    endpoints: tuple[str, ...] = ()
    capacity_tokens: int = 0
    tp: int = 1
    pp: int = 1
    layout: dict | None = None
    kv_events: dict | None = None  # a vLLM server's relayed KV events: pub, replay, incarnation[, curve key]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["endpoints"] = list(self.endpoints)
        if self.kv_events is None:  # optional: a record without it reads as before (older routers included)
            del d["kv_events"]
        return d


_FIELDS: dict[str, tuple] = {"cluster": (str,), "worker_id": (str,), "role": (str,), "url": (str,),
                             "model": (str,), "incarnation": (str,), "started_ns": (int,),
                             "endpoints": (list,), "capacity_tokens": (int,), "tp": (int,), "pp": (int,),
                             "layout": (dict, type(None)), "kv_events": (dict, type(None))}
_KV_EVENTS_KEYS = ("pub", "replay", "incarnation", "curve_server_key")


def registry_key(token: str, cluster: str) -> bytes:
    """The HMAC key of a cluster's registry, derived from the deployment's internal token."""
    return hmac.new(token.encode(), b"kvbridge registry v1\0" + cluster.encode(), hashlib.sha256).digest()


def access_proof(key: bytes) -> str:
    """What a caller of the router's registry routes presents (derived: never the token itself)."""
    return hmac.new(key, b"kvbridge registry access", hashlib.sha256).hexdigest()


def workers_prefix(cluster: str) -> str:
    return f"/kvbridge/{cluster}/workers/"


def worker_key(cluster: str, worker_id: str) -> str:
    return workers_prefix(cluster) + worker_id


def _canonical(record: dict) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()


def encode(rec: WorkerRecord, key: bytes) -> str:
    body = rec.to_json()
    sig = hmac.new(key, _canonical(body), hashlib.sha256).hexdigest()
    return json.dumps({"v": RECORD_VERSION, "record": body, "sig": sig}, separators=(",", ":"))


def decode(store_key: str, value: str, key: bytes) -> WorkerRecord:
    """The WorkerRecord in a registry value stored under `store_key`.

    Raises:
        RegistrationRefused: not JSON, a wrong version, no or a wrong signature (forged), a bad field, or a
            record that does not belong under this key.
    """
    if len(value) > MAX_VALUE_BYTES:
        raise RegistrationRefused("malformed", f"{store_key}: {len(value)} bytes (at most {MAX_VALUE_BYTES})")
    try:
        d = json.loads(value)
    except ValueError:
        raise RegistrationRefused("malformed", f"{store_key}: not JSON") from None
    if not isinstance(d, dict) or type(d.get("v")) is not int:
        raise RegistrationRefused("malformed", f"{store_key}: not a kvbridge worker registration")
    if d["v"] != RECORD_VERSION:
        raise RegistrationRefused("malformed", f"{store_key}: record version {d['v']}, this router reads "
                                               f"{RECORD_VERSION}")
    body, sig = d.get("record"), d.get("sig")
    if not isinstance(body, dict):
        raise RegistrationRefused("malformed", f"{store_key}: record: expected a mapping")
    if not isinstance(sig, str) or not sig:
        raise RegistrationRefused("forged", f"{store_key}: no signature (a registration must be signed with "
                                            f"the key derived from the deployment's internal token)")
    want = hmac.new(key, _canonical(body), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(sig.encode("ascii", "replace"), want.encode()):
        raise RegistrationRefused("forged", f"{store_key}: the signature does not match (not signed with this "
                                            f"deployment's internal token and cluster name)")
    rec = _record(store_key, body)
    if store_key.rsplit("/", 1)[-1] != rec.worker_id:
        raise RegistrationRefused("malformed", f"{store_key}: the record names worker {rec.worker_id!r}")
    return rec


def _record(store_key: str, body: dict) -> WorkerRecord:
    bad = sorted(set(body) - set(_FIELDS))
    if bad:
        raise RegistrationRefused("malformed", f"{store_key}: record.{bad[0]}: unknown field")
    for k, types in _FIELDS.items():
        if k not in body and k not in ("endpoints", "capacity_tokens", "tp", "pp", "layout", "kv_events"):
            raise RegistrationRefused("malformed", f"{store_key}: record.{k}: missing")
        v = body.get(k)
        if k in body and (isinstance(v, bool) or not isinstance(v, types)):
            raise RegistrationRefused("malformed", f"{store_key}: record.{k}: {v!r:.60} is not "
                                                   f"{'/'.join(t.__name__ for t in types)}")
    if body["role"] not in ROLES:
        raise RegistrationRefused("malformed", f"{store_key}: record.role: {body['role']!r} is not one of "
                                               f"{ROLES}")
    if not body["url"].startswith(("http://", "https://")):
        raise RegistrationRefused("malformed", f"{store_key}: record.url: {body['url']!r:.80} is not http(s)")
    eps = body.get("endpoints", [])
    if not all(isinstance(e, str) for e in eps):
        raise RegistrationRefused("malformed", f"{store_key}: record.endpoints: expected strings")
    kv = body.get("kv_events")
    if kv is not None and (set(kv) - set(_KV_EVENTS_KEYS) or not all(isinstance(kv.get(k), str) and
                                                                      0 < len(kv[k]) <= 200 for k in kv)
                           or not all(k in kv for k in _KV_EVENTS_KEYS[:3])):
        raise RegistrationRefused("malformed", f"{store_key}: record.kv_events: expected pub, replay and "
                                               f"incarnation (and curve_server_key) as short strings")
    return WorkerRecord(**{**body, "endpoints": tuple(eps)})
