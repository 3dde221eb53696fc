"""Generic checks of a client's JSON, shared by the router (once, before any hop) and the workers.

Owns what is true of every field whatever it means: the body is strict JSON (no NaN/Infinity, which Python's
json module would accept), nested at most MAX_JSON_DEPTH deep, integers fit int64, numbers are finite;
and the OpenAI shapes the router accepts but a worker never sees: message content as a list of text parts
(joined to one string here). Per-field meaning (ranges of sampling fields) lives in protocol.py. Never
raises anything but ApiError(400/413) for bad input: a malformed body can fail its request, never a process.
"""

from __future__ import annotations

import json
from typing import Any

from .api_error import ApiError

__all__ = ["MAX_JSON_DEPTH", "INT64_MAX", "loads_strict", "check_depth", "text_content", "GREEDY_BELOW"]

MAX_JSON_DEPTH = 32          # deeper request bodies are refused (OpenAI bodies nest 4-5 deep)
INT64_MAX = (1 << 63) - 1    # integers travel to the ranks as msgpack int64
GREEDY_BELOW = 1e-5          # a temperature below this samples greedily (1/T would overflow float32)


class _Constant(str):
    """Where the body had NaN/Infinity/-Infinity (found after parsing, so the 400 can name the field)."""


def _no_constant(obj: Any) -> None:
    """ApiError(400) naming the first field (top-level key as `param`, full path in the message) that holds
    NaN, Infinity or -Infinity. One pass; path strings are made only for containers and the culprit."""
    stack: list[tuple[Any, str, str | None]] = [(obj, "", None)]
    while stack:
        v, path, top = stack.pop()
        items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
        for k, c in items:
            if isinstance(c, (_Constant, dict, list)):
                sub = (f"{path}.{k}" if path else str(k)) if isinstance(v, dict) else f"{path}[{k}]"
                first = top if top is not None else (str(k) if isinstance(v, dict) else None)
                if isinstance(c, _Constant):
                    raise ApiError(400, f"{sub}: {c} is not a number JSON allows (the request body is not "
                                        "strict JSON)", code="invalid_json", param=first)
                stack.append((c, sub, first))
    if isinstance(obj, _Constant):
        raise ApiError(400, f"the request body is not strict JSON: {obj} is not a number JSON allows",
                       code="invalid_json")


def loads_strict(data: bytes | bytearray | str) -> Any:
    """Parse a request body: ApiError(400) naming the problem for non-JSON, NaN/Infinity, or too deep."""
    try:
        obj = json.loads(data, parse_constant=_Constant)
    except RecursionError:
        obj = None
        _too_deep()
    except ValueError as e:
        raise ApiError(400, f"the request body is not JSON: {e}", code="invalid_json") from None
    check_depth(obj)
    _no_constant(obj)
    return obj


def _too_deep() -> None:
    raise ApiError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")


def check_depth(obj: Any, limit: int = MAX_JSON_DEPTH) -> None:
    """ApiError(400) when `obj` nests lists/objects deeper than `limit` (iterative: no recursion)."""
    stack = [(obj, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            if d > limit:
                _too_deep()
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))


def text_content(content: Any, where: str) -> str:
    """A chat message's content as one string: a string, or a list of {"type": "text", "text": str} parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise ApiError(400, f"{where}.content: expected a string or a non-empty list of text parts",
                       param="messages")
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ApiError(400, f"{where}.content[{j}]: only text parts are supported, got {kind!r}",
                           code="unsupported", param="messages")
        if not isinstance(part.get("text"), str):
            raise ApiError(400, f"{where}.content[{j}].text: expected a string", param="messages")
        out.append(part["text"])
    return "".join(out)
