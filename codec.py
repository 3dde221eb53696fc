"""Strict msgpack: the only way kvbridge turns bytes from a peer (or a file) into Python values.

No ext types, no pickle, bounded sizes and nesting, string map keys only. Anything else raises
`ProtocolError` naming what was wrong. Used by agents' metadata and by the transceiver's wire messages.
"""

from __future__ import annotations

from typing import Any

import msgpack

from .errors import ProtocolError

__all__ = ["pack", "unpack", "MAX_FRAME_BYTES", "MAX_DEPTH"]

MAX_FRAME_BYTES = 64 << 20  # one control-plane frame; block-id lists of 1M blocks fit with room to spare
MAX_DEPTH = 8
MAX_CONTAINER = 1 << 17  # elements of one array or map (a 100k-id heartbeat is the largest legitimate list)
MAX_ITEMS = 1 << 20  # elements of all arrays and maps of one input: one byte must not become one object


def _no_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack ext type {code} is not accepted")


def pack(obj: Any) -> bytes:
    """Serialize plain data (dict/list/str/bytes/int/float/bool/None) to msgpack."""
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes, *, max_bytes: int = MAX_FRAME_BYTES, max_depth: int = MAX_DEPTH,
           max_container: int = MAX_CONTAINER, max_items: int = MAX_ITEMS, what: str = "frame") -> Any:
    """Decode msgpack from an untrusted source.

    Args:
        data: the bytes received.
        max_bytes: refuse larger inputs before decoding.
        max_depth: refuse containers nested deeper than this.
        max_container: refuse an array or map with more elements than this (checked before it is built).
        max_items: refuse inputs whose arrays and maps hold more elements than this in all (an expansion
            bomb: a frame of one-byte elements would otherwise become one Python object per byte).
        what: a name for the input, used in error messages.
    Raises:
        ProtocolError: naming what was wrong (size, truncation, ext type, nesting, trailing bytes).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"{what}: expected bytes, got {type(data).__name__}")
    n = len(data)
    if n == 0:
        raise ProtocolError(f"{what}: empty")
    if n > max_bytes:
        raise ProtocolError(f"{what}: {n} bytes exceeds the limit of {max_bytes}")
    budget = [max_items]

    def count(container):
        budget[0] -= len(container)
        if budget[0] < 0:
            raise ProtocolError(f"{what}: more than {max_items} elements in all (an expansion bomb?)")
        return container

    try:
        obj = msgpack.unpackb(
            data, raw=False, strict_map_key=True, ext_hook=_no_ext, use_list=True, list_hook=count,
            object_hook=count, max_str_len=n, max_bin_len=n, max_array_len=min(n, max_container),
            max_map_len=min(n, max_container), max_ext_len=n,
        )
    except ProtocolError:
        raise
    except msgpack.ExtraData:
        raise ProtocolError(f"{what}: trailing bytes after the message") from None
    except (ValueError, msgpack.UnpackException, TypeError) as e:
        kind = "truncated" if "incomplete" in str(e).lower() or isinstance(e, msgpack.OutOfData) else "malformed"
        raise ProtocolError(f"{what}: {kind} msgpack ({e})") from None
    except RecursionError:
        raise ProtocolError(f"{what}: nested too deeply") from None
    _check_depth(obj, max_depth, what)
    return obj


_SCALAR_TYPES = frozenset({int, str, bytes, bool, float, type(None)})  # what msgpack makes of plain scalars


def _check_depth(obj: Any, max_depth: int, what: str) -> None:
    """Nesting depth, and plain values only (msgpack decodes ext type -1, timestamps, without ext_hook)."""
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, msgpack.Timestamp):
            raise ProtocolError(f"{what}: msgpack ext type -1 (timestamp) is not accepted")
        if isinstance(o, (dict, list)):
            if d > max_depth:
                raise ProtocolError(f"{what}: containers nested deeper than {max_depth}")
            # scalars need no visit (a control frame is a flat map of them): only containers go on the stack
            stack.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o)
                         if type(v) not in _SCALAR_TYPES)
