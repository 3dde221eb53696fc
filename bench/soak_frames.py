"""Soak, part A1: mutated control frames into `transceiver.messages.decode`, timed one by one.

Owns the frame mutator (also used by the live hammer, soak_live.py) and the decoder loop. Every frame must
give a Message or a ProtocolError (anything else is a crash), within a per-frame bound (slower is a hang).
Decoded Hello/Welcome/Heartbeat frames also go through the first validation the ranks apply to them (layout
from_wire + compatibility, integer lists), where only KvBridgeError may come out. Never calls mapping_for on
a decoded layout (an unbounded TP there is a known stall, tests/reliability/test_layout_bounds.py).
"""

from __future__ import annotations

import struct
import time
from collections import Counter, defaultdict
from collections.abc import Iterator

import numpy as np

from ..codec import pack, unpack
from ..errors import KvBridgeError, ProtocolError
from ..formatter.layout import KVLayout, KVShape
from ..formatter.mapping import MAPPING_VERSION, check_compatible
from ..transceiver import messages as m

LAY = KVLayout(KVShape(2, 2, 8, "float32", 16))
LAY_TP2 = KVLayout.from_wire({**LAY.to_wire(), "tp": 2})

# category -> weight (per mille); "bomb" and "oversized" are counted apart (see FrameMutator.bombs)
WEIGHTS = {
    "bitflip": 250,
    "bytes": 150,
    "truncate": 100,
    "splice": 100,
    "random": 100,
    "fields": 150,
    "type": 30,
    "version": 30,
    "declared_len": 40,
    "deep": 25,
    "ext": 25,
}
_ODD_VALUES = [
    None,
    True,
    False,
    0,
    -1,
    1 << 40,
    (1 << 63) - 1,
    -(1 << 63),
    (1 << 64) - 1,
    1.5,
    float("nan"),
    float("inf"),
    "",
    "x" * 300,
    "\u00e9",
    b"",
    b"\x00" * 9,
    b"\xff" * 17,
    [],
    [1, 2, 3],
    [None],
    {},
    {"a": 1},
    {"num_layers": 2},
    list(range(50)),
]


def valid_frames() -> list[bytes]:
    """Valid frames of every message type, a few variants each."""
    lw, lw2 = LAY.to_wire(), LAY_TP2.to_wire()
    out = [
        m.Hello("gen-a", 0, lw, ["nixl"], mapping_version=MAPPING_VERSION),
        m.Hello("gen-b", 1, lw2, ["nixl", "cuda_ipc"], "host/boot", MAPPING_VERSION),
        m.Welcome("ctx", 0, lw, {"nixl": b"\x01" * 40}, [1 << 40], 8, "DRAM", 0, 5.0),
        m.Welcome(
            "ctx", 1, lw2, {"nixl": b"x", "cuda_ipc": b"y"}, [1 << 41, 1 << 42], 1024, "VRAM", 1, 2.5, "h"
        ),
        m.Fetch(7, 0),
        m.Fetch(1 << 40, 3, True),
        m.Blocks(7, np.arange(9), 130, 2, 5.0),
        m.Blocks(8, np.arange(1000)[::-1], 16000, 0, 1.0),
        m.LayersReady(7, 1),
        m.Heartbeat([1, 2, 3]),
        m.Heartbeat(list(range(200))),
        m.HeartbeatAck([1, 2], [True, False]),
        m.Done(7, 0, True, "", [b"12345678", b"abcdefgh"]),
        m.Done(7, 1, False, "read failed: peer gone"),
        m.DoneAck(7, True),
        m.DoneAck(7, False, "lease expired", False),
        m.Error("malformed", "bad frame"),
        m.Error("lease_expired", "request 7 expired", 7, "fetch"),
    ]
    frames = [x.encode() for x in out]
    if {m.decode(f).TYPE for f in frames} != set(m.MESSAGE_TYPES):
        raise RuntimeError("soak: the valid frame set misses a message type")
    return frames


class FrameMutator:
    """Deterministic stream of (category, frame) from a seed."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.valid = valid_frames()
        self.maps = [unpack(f) for f in self.valid]
        names = list(WEIGHTS)
        w = np.array([WEIGHTS[k] for k in names], dtype=float)
        self._names, self._p = names, w / w.sum()

    def stream(self, n: int) -> Iterator[tuple[str, bytes]]:
        cats = self.rng.choice(len(self._names), size=n, p=self._p)
        for c in cats:
            name = self._names[c]
            yield name, getattr(self, "_" + name)()

    def _pick(self) -> bytes:
        return self.valid[int(self.rng.integers(len(self.valid)))]

    def _bitflip(self) -> bytes:
        b = bytearray(self._pick())
        for _ in range(int(self.rng.integers(1, 9))):
            i = int(self.rng.integers(len(b) * 8))
            b[i >> 3] ^= 1 << (i & 7)
        return bytes(b)

    def _bytes(self) -> bytes:
        b = bytearray(self._pick())
        for _ in range(int(self.rng.integers(1, 5))):
            b[int(self.rng.integers(len(b)))] = int(self.rng.integers(256))
        return bytes(b)

    def _truncate(self) -> bytes:
        b = self._pick()
        return b[: int(self.rng.integers(0, len(b)))]

    def _splice(self) -> bytes:
        a, b = self._pick(), self._pick()
        return a[: int(self.rng.integers(0, len(a) + 1))] + b[int(self.rng.integers(0, len(b))) :]

    def _random(self) -> bytes:
        n = int(self.rng.integers(0, 513))
        head = bytes([int(self.rng.choice([0x80, 0x81, 0x85, 0x8F, 0xDE, 0xDF, 0x90, 0xDC, 0xC4, 0xD9]))])
        body = self.rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        return head + body if self.rng.random() < 0.5 else body

    def _fields(self) -> bytes:
        d = dict(self.maps[int(self.rng.integers(len(self.maps)))])
        keys = [k for k in d if k not in ("v", "t")]
        op = self.rng.random()
        if op < 0.6 and keys:
            d[keys[int(self.rng.integers(len(keys)))]] = _ODD_VALUES[int(self.rng.integers(len(_ODD_VALUES)))]
        elif op < 0.8 and keys:
            del d[keys[int(self.rng.integers(len(keys)))]]
        else:
            d[f"extra{int(self.rng.integers(100))}"] = _ODD_VALUES[int(self.rng.integers(len(_ODD_VALUES)))]
        if isinstance(d.get("gen_layout"), dict) and d["gen_layout"] and self.rng.random() < 0.5:
            lay = dict(d["gen_layout"])
            k = list(lay)[int(self.rng.integers(len(lay)))]
            lay[k] = (
                _ODD_VALUES[int(self.rng.integers(len(_ODD_VALUES)))]
                if self.rng.random() < 0.5
                else int(self.rng.integers(-3, 70))
            )
            d["gen_layout"] = lay
        return pack(d)

    def _type(self) -> bytes:
        d = dict(self.maps[int(self.rng.integers(len(self.maps)))])
        d["t"] = [None, 7, "", "hello ", "HELLO", "fetch\x00", "done_ack2", b"fetch", ["fetch"]][
            int(self.rng.integers(9))
        ]
        return pack(d)

    def _version(self) -> bytes:
        d = dict(self.maps[int(self.rng.integers(len(self.maps)))])
        v = [0, 2, -1, "1", None, 1.0, True, (1 << 64) - 1, b"\x01"][int(self.rng.integers(9))]
        if v is None and self.rng.random() < 0.5:
            del d["v"]
        else:
            d["v"] = v
        return pack(d)

    def _declared_len(self) -> bytes:
        """Headers that claim far more bytes/items than the frame holds."""
        tag = [b"\xc6", b"\xdb", b"\xdd", b"\xdf", b"\xc9", b"\xc5", b"\xda", b"\xdc", b"\xde"][
            int(self.rng.integers(9))
        ]
        wide = tag in (b"\xc6", b"\xdb", b"\xdd", b"\xdf", b"\xc9")
        n = int(self.rng.integers(1 << 20, 1 << 32)) if wide else int(self.rng.integers(256, 1 << 16))
        head = tag + (struct.pack(">I", n) if wide else struct.pack(">H", n))
        if tag == b"\xc9":
            head += b"\x05"
        body = self.rng.integers(0, 256, int(self.rng.integers(0, 64)), dtype=np.uint8).tobytes()
        if self.rng.random() < 0.5:  # inside an otherwise valid map
            return bytes([0x83]) + pack("v") + b"\x01" + pack("t") + pack("fetch") + pack("x") + head + body
        return head + body

    def _deep(self) -> bytes:
        d = int(self.rng.choice([9, 16, 100, 1000, 10000, 100000]))
        opener = b"\x91" if self.rng.random() < 0.5 else b"\x81\xa1k"
        inner = opener * d + b"\xc0"
        return b"\x83\xa1v\x01\xa1t\xa5fetch\xa1x" + inner if self.rng.random() < 0.5 else inner

    def _ext(self) -> bytes:
        code = int(self.rng.choice([-1, -1, 0, 1, 5, 127, -128]))
        payload = self.rng.integers(
            0, 256, int(self.rng.choice([1, 2, 4, 8, 12, 16])), dtype=np.uint8
        ).tobytes()
        ext = _ext_bytes(code, payload)
        d = pack({"v": 1, "t": "fetch", "ctx_request_id": 1, "gen_rank": 0})
        if self.rng.random() < 0.5:
            return ext
        return bytes([d[0] + 1]) + d[1:] + pack("x") + ext

    def bombs(self) -> list[tuple[str, bytes]]:
        """Expansion bombs: a valid Fetch plus an ignored field of one-byte elements (test_frame_bombs.py)."""
        out = []
        for n in (1 << 16, 1 << 18, 1 << 20):
            for el, name in ((b"\x80", "empty maps"), (b"\x90", "empty lists"), (b"\xc0", "nils")):
                head = pack({"v": 1, "t": "fetch", "ctx_request_id": 1, "gen_rank": 0})
                out.append(
                    (
                        f"bomb {n} {name}",
                        bytes([0x85]) + head[1:] + pack("x") + b"\xdd" + struct.pack(">I", n) + el * n,
                    )
                )
        return out

    def oversized(self, count: int) -> Iterator[tuple[str, bytes]]:
        """Frames just over and far over the control-frame limit (a few shared buffers, no copy per frame)."""
        bigs = [
            bytes([0x81, 0xA1, 0x78, 0xC6]) + struct.pack(">I", m.MAX_FRAME_BYTES) + bytes(m.MAX_FRAME_BYTES),
            self._pick() + bytes(m.MAX_FRAME_BYTES),
            bytes(m.MAX_FRAME_BYTES + 1),
        ]
        for i in range(count):
            yield "oversized", bigs[i % len(bigs)]


def _ext_bytes(code: int, payload: bytes) -> bytes:
    n = len(payload)
    fix = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}
    c = struct.pack(">b", code)
    if n in fix:
        return bytes([fix[n]]) + c + payload
    return b"\xc7" + bytes([n]) + c + payload


def _validate(msg: m.Message) -> None:
    """What a rank checks first on these messages (the sender on a Hello, the receiver on a Welcome, both on
    heartbeats)."""
    if isinstance(msg, m.Hello):
        check_compatible(LAY, KVLayout.from_wire(msg.gen_layout))
    elif isinstance(msg, m.Welcome):
        check_compatible(KVLayout.from_wire(msg.ctx_layout), LAY)
        m.int_list(msg.pool_bases, "welcome pool_bases", 100000)
    elif isinstance(msg, m.Heartbeat):
        m.int_list(msg.ctx_request_ids, "heartbeat", 100000)


class DecodeStats:
    """Per category: frames, decoded, crashes, hangs (best of up to 3 timings over the bound), max, mean."""

    def __init__(self, bound_s: float) -> None:
        self.bound_s = bound_s
        self.n: Counter = Counter()
        self.decoded: Counter = Counter()
        self.crashes: list[dict] = []
        self.hangs: list[dict] = []
        self.retimed: list[dict] = []  # over the bound once, then timed again
        self.max_s: dict[str, float] = defaultdict(float)
        self.total_s: dict[str, float] = defaultdict(float)

    def feed(self, cat: str, frame: bytes) -> None:
        key = cat.split(" ")[0]
        t0 = time.perf_counter()
        try:
            msg = m.decode(frame)
            try:
                _validate(msg)
            except KvBridgeError:
                pass
            self.decoded[key] += 1
        except ProtocolError:
            pass
        except Exception as e:  # noqa: BLE001 - that is what we count
            if len(self.crashes) < 20:
                self.crashes.append(
                    {
                        "category": cat,
                        "error": f"{type(e).__name__}: {e}"[:300],
                        "frame_head": frame[:48].hex(),
                    }
                )
            else:
                self.crashes.append({"category": cat})
        dt = time.perf_counter() - t0
        if (
            dt > self.bound_s
        ):  # a slow decode is timed again: a busy machine preempts, a slow frame stays slow
            first = dt
            for _ in range(2):
                dt = min(dt, self._retime(frame))
                if dt <= self.bound_s:
                    break
            self.retimed.append({"category": cat, "first_s": round(first, 3), "best_s": round(dt, 4)})
        self.n[key] += 1
        self.total_s[key] += dt
        self.max_s[key] = max(self.max_s[key], dt)
        if dt > self.bound_s:
            self.hangs.append({"category": cat, "seconds": round(dt, 3), "bytes": len(frame)})

    @staticmethod
    def _retime(frame: bytes) -> float:
        t0 = time.perf_counter()
        try:
            _validate(m.decode(frame))
        except Exception:  # noqa: BLE001, S110 - the first decode already classified it
            pass
        return time.perf_counter() - t0

    def rows(self) -> list[dict]:
        return [
            {
                "category": k,
                "frames": self.n[k],
                "decoded": self.decoded[k],
                "crashes": sum(1 for c in self.crashes if c["category"].split(" ")[0] == k),
                "hangs": sum(1 for h in self.hangs if h["category"].split(" ")[0] == k),
                "max_ms": round(self.max_s[k] * 1e3, 3),
                "mean_us": round(self.total_s[k] / self.n[k] * 1e6, 2),
            }
            for k in sorted(self.n)
        ]


def run_decoder(
    frames: int, seed: int, bound_s: float, bombs: bool = True, oversized: int = 1000, progress=None
) -> DecodeStats:
    """Feed exactly `frames` frames in all: the valid ones first, then up to `oversized` oversized frames
    (a tenth of the total at most) and, optionally, the expansion bombs, the rest mutated frames; each part is
    cut where the total runs out."""
    mut = FrameMutator(seed)
    st = DecodeStats(bound_s)
    valid = mut.valid[:frames]
    extra = list(mut.bombs()) if bombs else []
    n_over = min(oversized, frames // 10)
    extra = extra[: max(0, frames - len(valid) - n_over)]
    n_stream = max(0, frames - len(valid) - n_over - len(extra))
    for f in valid:
        st.feed("valid", f)
    for i, (cat, f) in enumerate(mut.stream(n_stream)):
        st.feed(cat, f)
        if progress and i % 200_000 == 0:
            progress(f"decoder: {i} frames")
    for cat, f in mut.oversized(n_over):
        st.feed(cat, f)
    for cat, f in extra:
        st.feed(cat, f)
    return st
