"""The strict codec of the executor's internal messages (step plans, pipe messages, events).

A message is a frozen dataclass deriving from `Wire` whose fields are declared with `wf(kind)`. Its wire
form is the list of its field values in declaration order (plain msgpack data, compact: the plan is built
and decoded every step); `from_wire` checks the length and every field's type and raises ExecutorError
naming the message and the field. New fields go at the end, with a default, so a shorter list still decodes.
Unions of messages (op kinds, pipe message kinds) are tagged by an enum value in front: `Table`.

Kinds: int, bool, str, float (an int is accepted), list, dict, bytes; an Enum class (its value on the wire);
a class with to_wire/from_wire (nested); `wf(..., none=True)` also accepts None. bool is never an int.
Element types of lists (token ids) are not checked one by one: a bad element fails where it is used (torch)
and a per-token loop would cost every step. Owns the codec only; never decides what a message means.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable

from ..errors import ExecutorError, KvBridgeError

__all__ = ["Wire", "wf", "Table", "need"]

_PLAIN = {int: int, bool: bool, str: str, float: (float, int), list: list, dict: dict, bytes: bytes}


def wf(kind: Any, default: Any = dataclasses.MISSING, *, none: bool = False, of: Any = None,
       compare: bool = True) -> Any:
    """A message field of `kind` (see the module docstring); none=True also accepts None; of=T: a list (a
    tuple in the message) of nested T; compare=False: left out of == (a timestamp)."""
    md = {"kind": kind, "none": none, "of": of}
    if default is dataclasses.MISSING:
        return dataclasses.field(metadata=md, compare=compare)
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=md, compare=compare)
    return dataclasses.field(default=default, metadata=md, compare=compare)


def need(value: Any, kind: Any, what: str) -> Any:
    """`value` checked to be of plain `kind` (bool is not an int); ExecutorError naming `what` otherwise."""
    want = _PLAIN[kind]
    if not isinstance(value, want) or (kind is not bool and isinstance(value, bool)):
        raise ExecutorError(f"{what} is {value!r:.80}, expected {kind.__name__}")
    return float(value) if kind is float else value


def _decoder(kind: Any, none: bool, what: str, of: Any = None) -> Callable[[Any], Any]:
    if of is not None:
        item = _decoder(of, False, what + "[]")

        def dec(v):
            return tuple(item(x) for x in need(v, list, what))
    elif kind in _PLAIN:
        def dec(v):
            return need(v, kind, what)
    elif isinstance(kind, type) and issubclass(kind, enum.Enum):
        def dec(v):
            try:
                return kind(v)
            except ValueError:
                raise ExecutorError(f"{what} is {v!r:.40}, not a {kind.__name__}") from None
    else:
        def dec(v):
            try:
                return kind.from_wire(v)
            except ExecutorError as e:
                raise ExecutorError(f"{what}: {e}") from None
            except (KvBridgeError, ValueError) as e:  # another module's type (TransferStats, SamplingParams)
                raise ExecutorError(f"{what}: {e}") from None
    if not none:
        return dec
    return lambda v: None if v is None else dec(v)


def _encoder(kind: Any, of: Any = None) -> Callable[[Any], Any] | None:
    if of is not None:
        return lambda v: [x.to_wire() for x in v]
    if kind in _PLAIN:
        return None
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return lambda v: v.value if v is not None else None
    return lambda v: v.to_wire() if v is not None else None


class Wire:
    """Base of a message: `to_wire()` -> list of field values; `from_wire(data)` strict (module docstring)."""

    __slots__ = ()

    @classmethod
    def _fields(cls) -> tuple:
        spec = cls.__dict__.get("_spec_cache")
        if spec is None:
            md = [f.metadata for f in dataclasses.fields(cls)]
            spec = tuple((f.name, _encoder(m["kind"], m["of"]),
                          _decoder(m["kind"], m["none"], f"{cls.__name__}.{f.name}", m["of"]),
                          f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                         for f, m in zip(dataclasses.fields(cls), md))
            type.__setattr__(cls, "_spec_cache", spec)
        return spec

    def to_wire(self) -> list:
        return [getattr(self, n) if enc is None else enc(getattr(self, n)) for n, enc, _, _ in self._fields()]

    @classmethod
    def from_wire(cls, data: Any):
        spec = cls._fields()
        if not isinstance(data, list):
            raise ExecutorError(f"{cls.__name__}: expected a list of fields, got {type(data).__name__}")
        required = sum(1 for *_, req in spec if req)
        if not required <= len(data) <= len(spec):
            raise ExecutorError(f"{cls.__name__}: {len(data)} fields, expected {required}..{len(spec)}")
        return cls(*[dec(v) for (_, _, dec, _), v in zip(spec, data)])


class Table:
    """A tagged union of message types: wire form [tag, *fields]; the tag is an Enum member's value.

    Args:
        what: the union's name in errors ("step plan op", "command", ...).
        types: tag (an Enum member) -> message class (one class per tag).
    """

    def __init__(self, what: str, types: dict) -> None:
        self.what = what
        self.types = dict(types)
        self.tag_of = {cls: k.value for k, cls in types.items()}
        self._by_value = {k.value: cls for k, cls in types.items()}

    def encode(self, msg: Any) -> list:
        tag = self.tag_of.get(type(msg))
        if tag is None:
            raise ExecutorError(f"{self.what}: {type(msg).__name__} is not one of {sorted(self._by_value)}")
        return [tag, *msg.to_wire()]

    def decode(self, data: Any) -> Any:
        if not isinstance(data, list) or not data:
            raise ExecutorError(f"{self.what}: expected [kind, fields...], got {data!r:.80}")
        cls = self._by_value.get(data[0]) if isinstance(data[0], str) else None
        if cls is None:
            raise ExecutorError(f"{self.what}: unknown kind {data[0]!r:.40} (known: {sorted(self._by_value)})")
        return cls.from_wire(data[1:])
