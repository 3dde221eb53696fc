"""The one rule every transceiver state machine follows: a state changes only through its table.

Each machine (a pull, a pull's leg, a context peer as a generation rank sees it, a published request on a
context rank) declares its states as an enum and its legal moves as a table `{state: frozenset(next states)}`;
its single `advance(to)` method calls `move` here, which returns the new state or raises IllegalTransition
naming the machine and both states. Owns nothing else: never logs, never touches sockets, pools or clocks.
"""

from __future__ import annotations

from enum import Enum
from typing import Mapping, TypeVar

from ..errors import TransceiverError

__all__ = ["IllegalTransition", "move"]

S = TypeVar("S", bound=Enum)


class IllegalTransition(TransceiverError):
    """A state machine was asked for a move its table does not allow: a bug in the transceiver, not bad input
    (peer input that does not fit the state is checked, and answered, before any move)."""


def move(machine: str, table: Mapping[S, frozenset[S]], old: S, new: S) -> S:
    """`new` if `table` allows old -> new, else IllegalTransition("<machine>: <old> -> <new> is not allowed")."""
    if new not in table.get(old, frozenset()):
        allowed = ", ".join(sorted(str(s) for s in table.get(old, frozenset()))) or "none (terminal)"
        raise IllegalTransition(f"{machine}: {old} -> {new} is not allowed (from {old}: {allowed})")
    return new
