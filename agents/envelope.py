"""The envelope around every agent's metadata blob: which agent kind made it, its name, a format version.

`connect()` on one agent kind with another kind's metadata fails with a clear PeerError instead of feeding
foreign bytes to a native library.
"""

from __future__ import annotations

from typing import Any

from ..codec import pack, unpack
from ..errors import PeerError, ProtocolError

METADATA_VERSION = 1


def seal(kind: str, name: str, payload: dict[str, Any]) -> bytes:
    """Wrap an agent's payload (plain msgpack-able values) in the common envelope."""
    return pack({"kvbridge_agent": kind, "v": METADATA_VERSION, "name": name, "payload": payload})


def open_envelope(blob: bytes, kind: str) -> tuple[str, dict[str, Any]]:
    """Return (peer name, payload) from a peer's metadata; PeerError if it is not `kind`'s metadata."""
    try:
        env = unpack(blob, what="agent metadata")
    except ProtocolError as e:
        raise PeerError(str(e)) from None
    if not isinstance(env, dict) or "kvbridge_agent" not in env:
        raise PeerError("peer metadata is not a kvbridge agent envelope")
    if env["kvbridge_agent"] != kind:
        raise PeerError(f"peer metadata is from a {env['kvbridge_agent']!r} agent, this is a {kind!r} agent")
    if env.get("v") != METADATA_VERSION:
        raise PeerError(f"peer metadata version {env.get('v')!r}, this agent speaks {METADATA_VERSION}")
    name, payload = env.get("name"), env.get("payload")
    if not isinstance(name, str) or not name or not isinstance(payload, dict):
        raise PeerError("peer metadata lacks a name or payload")
    return name, payload


def field(payload: dict[str, Any], key: str, typ: type | tuple[type, ...], what: str = "peer metadata") -> Any:
    """payload[key], checked to be of `typ`; PeerError naming the field otherwise."""
    if key not in payload:
        raise PeerError(f"{what}: missing field {key!r}")
    v = payload[key]
    if not isinstance(v, typ) or (isinstance(v, bool) and bool not in (typ if isinstance(typ, tuple) else (typ,))):
        raise PeerError(f"{what}: field {key!r} has type {type(v).__name__}")
    return v
