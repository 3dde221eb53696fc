"""A worker's KV events under `policy: kv_aware`: the executor's settings, and what /health advertises.

The events themselves are published by the executor's leader rank (executor/kv_publisher.py); this module
only decides whether they are on (the deployment's router policy is kv_aware), derives their signing key from
the internal token (closed by default: without a token the worker refuses to start, naming why), and reads
back the endpoints the leader bound, to advertise them (with the worker's host and incarnation) on the
authenticated /health. When the worker's control plane runs CurveZMQ (its transceiver has a
`curve_secret_key_file`, as every worker under `kvbridge serve` does), the event sockets run CurveZMQ with
that key pair (executor/kv_curve.py) and /health advertises its public half (`curve_server_key`). Never opens a
socket.
"""

from __future__ import annotations

import json
import os
import time

from ..errors import ServeConfigError
from ..executor.kv_events import derive_secret
from .auth import internal_token

__all__ = ["advertised", "kv_events_settings"]


def kv_events_settings(cfg, spec, instance: str, run_dir: str) -> dict | None:
    """The ExecutorConfig.kv_events of worker `spec` (None: the router does not route by KV events)."""
    if cfg.router.policy != "kv_aware" and not spec.executor.get("kv_events"):
        return None  # executor.kv_events: true publishes them under any policy (another router, the bench)
    token = internal_token(cfg)
    if not token:
        raise ServeConfigError(f"{spec.name}: KV events (router.policy kv_aware) need the deployment's internal "
                               f"token (they are signed with a key derived from it): set KVBRIDGE_INTERNAL_TOKEN or "
                               f"internal_token")
    if spec.executor.get("enable_block_reuse") is False:
        raise ServeConfigError(f"{spec.name}: KV events (router.policy kv_aware) need executor.enable_block_reuse (a worker "
                               f"without a prefix cache has no KV to route by)")
    out = {"secret": derive_secret(token).hex(), "incarnation": instance, "host": spec.bind_host,
           "endpoint_file": os.path.join(run_dir, "kv-events.json")}
    curve = spec.transceiver.get("curve_secret_key_file")
    if curve:  # the control plane's CurveZMQ: the event sockets too, with the same key pair
        out["curve_secret_key_file"] = curve
    return out


def advertised(settings: dict, host: str, timeout: float) -> dict:
    """{pub, replay, incarnation[, curve_server_key]} as routers reach them, once the leader has bound (waits
    up to `timeout`)."""
    path, deadline = settings["endpoint_file"], time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise ServeConfigError(f"the executor did not open its KV event endpoints within {timeout:g} s")
        time.sleep(0.05)
    with open(path) as f:
        eps = json.load(f)
    out = {"incarnation": settings["incarnation"]}
    for k in ("pub", "replay"):
        port = str(eps[k]).rpartition(":")[2]
        out[k] = f"tcp://{host}:{port}"
    if isinstance(eps.get("curve_server_key"), str):
        out["curve_server_key"] = eps["curve_server_key"]
    return out
