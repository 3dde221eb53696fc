"""Frames an I/O thread queues during one loop turn, sent at the turn's end as one multipart message per peer;
and the rule for taking such a message apart on the other side (`each_part`).

A busy loop answers many requests per turn (a generation rank submits dozens at once under load; a context
rank confirms several Dones): one ZeroMQ message per peer per turn instead of one per frame costs one send, one
receive and one wake-up of each side's ZeroMQ thread for the lot. Each part is still one whole wire message
(messages.py), decoded and answered on its own, so a bad one fails only its own request. At most
`messages.MAX_BATCH` parts travel together; a receiver refuses a longer message.

Owned by one I/O thread (no locking). Never decodes, never reorders: frames to one peer leave in the order
they were queued. Frames queued for a peer whose socket is reset before the turn ends are dropped with it
(`drop`), exactly as frames queued in that socket would have been.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable

from .messages import MAX_BATCH

log = logging.getLogger(__name__)

__all__ = ["Outbox", "each_part"]


def each_part(parts: list[bytes], handle: Callable[[bytes], None], where: str) -> str:
    """Hand every part of one received message to `handle`, alone: a part whose handling raises is logged and
    skipped, the rest still handled. Returns the refusal ("" if none) of a message of no parts or more than
    MAX_BATCH, of which nothing is handled. `handle` may raise StopIteration to drop the remaining parts."""
    if not parts or len(parts) > MAX_BATCH:
        return f"expected 1 to {MAX_BATCH} frames per message, got {len(parts)}"
    for frame in parts:
        try:
            handle(frame)
        except StopIteration:
            break
        except Exception:  # one frame's failure must not drop the rest of its batch
            log.exception("handling a frame from %s failed", where)
    return ""


class Outbox:
    """Per-peer frame queues of one loop turn.

    Args:
        send_parts: sends one multipart message (at most MAX_BATCH frames) to a peer key; handles its own
            errors (a vanished peer, a full queue).
    """

    def __init__(self, send_parts: Callable[[Hashable, list[bytes]], None]) -> None:
        self._send_parts = send_parts
        self._boxes: dict[Hashable, list[bytes]] = {}

    def add(self, peer: Hashable, frame: bytes) -> None:
        box = self._boxes.get(peer)
        if box is None:
            self._boxes[peer] = [frame]
        else:
            box.append(frame)

    def drop(self, peer: Hashable) -> None:
        """Forget what was queued for `peer` (its socket is being closed)."""
        self._boxes.pop(peer, None)

    def __len__(self) -> int:
        return len(self._boxes)

    def flush(self) -> None:
        """Send everything queued: one multipart message per peer (more if over MAX_BATCH frames)."""
        if not self._boxes:
            return
        boxes, self._boxes = self._boxes, {}
        for peer, frames in boxes.items():
            for i in range(0, len(frames), MAX_BATCH):
                self._send_parts(peer, frames[i:i + MAX_BATCH])
