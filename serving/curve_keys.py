"""What a router knows of its deployment's CurveZMQ keys, for the workers' KV-event sockets.

`uses_curve(cfg)`: the control plane runs CurveZMQ (some group's transceiver has a key: `kvbridge serve`
makes them unless the config brings its own); the router then follows only workers whose event sockets run
CurveZMQ too. `expected_server_keys(cfg)`: the public key of each role that the config names without the
router reading anyone's secret key (context: the key generation workers pin, `curve_server_public_key_file`,
or the context group's `curve_public_key_file`; generation: its `curve_public_key_file`). A worker whose
advertised event key differs is not followed. A role the config names no public key for is trusted to
advertise its own on its authenticated /health (the router reaches it with the internal token).
"""

from __future__ import annotations

from ..errors import KvBridgeError, ServeConfigError
from ..executor.kv_curve import public_of

__all__ = ["expected_server_keys", "uses_curve"]

_KEYS = ("curve_secret_key_file", "curve_public_key_file", "curve_server_public_key_file",
         "curve_authorized_keys_dir")


def uses_curve(cfg) -> bool:
    return any(s.transceiver.get(k) for s in cfg.servers() for k in _KEYS)


def expected_server_keys(cfg) -> dict[str, str]:
    ctx = cfg.context[0].transceiver if cfg.context else {}
    gen = cfg.generation[0].transceiver if cfg.generation else {}
    files = {"context": gen.get("curve_server_public_key_file") or ctx.get("curve_public_key_file"),
             "generation": gen.get("curve_public_key_file")}
    out = {}
    for role, path in files.items():
        if path:
            try:
                out[role] = public_of(path)
            except KvBridgeError as e:
                raise ServeConfigError(f"router.policy kv_aware: the {role} workers' CurveZMQ public key: {e}") \
                    from None
    return out
