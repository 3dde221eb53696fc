"""The relay of vLLM's KV events (serving/vllm_kv_relay.py): keys equal the router's own chain keys, what
token-only keys cannot name is left out, a gap is filled from vLLM's replay socket (else, like a malformed
batch, it starts the relayed cache over), bad fields are named; and through real ZeroMQ (a PUB standing in
for vLLM's, fed hostile input) the router's subscriber (kv_subscriber.py, ZAP with the deployment's token)
ends with exactly what the relay mirrors. A real vLLM server feeds the relay in
tests/vllm/test_kv_aware_vllm.py and answers its replay in tests/vllm/test_vllm_kv_replay.py."""

from __future__ import annotations

import json
import os
import tempfile
import time

import pytest
import zmq
from kvbridge import codec
from kvbridge.errors import ProtocolError
from kvbridge.executor.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    KVEventLog,
    decode_batch,
    derive_secret,
)
from kvbridge.kvcache.prefix_tree import chain_keys, root_key
from kvbridge.serving.kv_index import KvIndex
from kvbridge.serving.kv_subscriber import KvEventsClient
from kvbridge.serving.vllm_kv_relay import VllmKvMirror, VllmKvRelay, fingerprint

BS = 4
FP = fingerprint("tiny", BS)
SECRET = derive_secret("the-deployment-token")


def _stored(hashes, parent, tokens, **extra) -> dict:
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent,
            "token_ids": list(tokens), "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None,
            **extra}


def _mirror() -> tuple[VllmKvMirror, KVEventLog]:
    m = VllmKvMirror(FP, BS)
    m.listener = KVEventLog(FP, BS, "GPU")
    m.listener.take_batch()  # (its first batch: AllBlocksCleared)
    return m, m.listener


def _events(log: KVEventLog) -> tuple:
    got = log.take_batch()
    return decode_batch(got[1]).events if got else ()


def test_keys_are_the_routers_chain_keys_whatever_vllm_hashes_are():
    m, log = _mirror()
    toks = list(range(10, 22))
    m.apply(_stored([111, 222], None, toks[:8]), 0)             # vLLM's default: 64-bit int hashes
    m.apply(_stored([b"\x07" * 32], 222, toks[8:12]), 1)       # or sha256 bytes; the parent by vLLM's hash
    want = chain_keys(FP, toks, BS)
    assert [k for k, _p, _n in m.snapshot()] == want
    ev = _events(log)
    assert [e.block_hashes for e in ev] == [tuple(want)] and ev[0].parent_block_hash is None
    m.apply({"type": "BlockRemoved", "block_hashes": [222], "medium": "GPU"}, 0)
    assert _events(log) == (BlockRemoved((want[1],), "GPU"),) and len(m) == 2
    m.apply({"type": "AllBlocksCleared"}, 0)
    assert len(m) == 0 and _events(log) == (AllBlocksCleared(),)


def test_blocks_token_only_keys_cannot_name_are_left_out():
    m, log = _mirror()
    toks = list(range(4))
    for ev in (_stored([1], None, toks, lora_name="adapter"), _stored([2], None, toks, lora_id=3),
               _stored([3], None, toks, extra_keys=[["salt"]]), _stored([4], None, toks, group_idx=1),
               _stored([5], 999, toks),                                   # a parent never seen
               {**_stored([6], None, toks * 2), "block_size": 8}):         # another block size
        m.apply(ev, 0)
    assert len(m) == 0 and m.skipped == 6 and _events(log) == ()
    m.apply(_stored([7], None, toks, extra_keys=[None]), 0)                # no extra key for it: indexed
    assert [k for k, _p, _n in m.snapshot()] == chain_keys(FP, toks, BS)


def test_two_vllm_hashes_of_one_key_leave_it_until_both_are_removed():
    m, log = _mirror()
    m.apply(_stored([1], None, [5, 6, 7, 8]), 0)
    m.apply(_stored([2], None, [5, 6, 7, 8]), 0)
    assert len(m) == 1 and len(_events(log)) == 1
    m.apply({"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}, 0)
    assert len(m) == 1 and _events(log) == ()
    m.apply({"type": "BlockRemoved", "block_hashes": [2, 3], "medium": "GPU"}, 0)  # (3: never stored)
    assert len(m) == 0 and len(_events(log)) == 1


@pytest.mark.parametrize("ev, named", [
    ([1, 2], "expected a map tagged by 'type'"),
    ({"type": "BlockSaved"}, "unknown event"),
    (_stored([], None, []), "block_hashes: expected a non-empty list"),
    (_stored([-1], None, [1, 2, 3, 4]), "block_hashes: a block hash must be"),
    (_stored([b""], None, [1, 2, 3, 4]), "block_hashes: a block hash must be"),
    (_stored([1 << 64], None, [1, 2, 3, 4]), "block_hashes: a block hash must be"),
    (_stored([1], "x", [1, 2, 3, 4]), "parent_block_hash"),
    (_stored([1], None, [1, 2, 3]), "token_ids: expected 4 non-negative ints"),
    (_stored([1], None, [1, 2, 3, -4]), "token_ids"),
    ({**_stored([1], None, [1, 2, 3, 4]), "block_size": 0}, "block_size: expected a positive int"),
    ({"type": "BlockRemoved", "block_hashes": "ab"}, "BlockRemoved|block_hashes"),
])
def test_a_malformed_event_is_refused_naming_the_field(ev, named):
    m, _log = _mirror()
    with pytest.raises(ProtocolError, match=named):
        m.apply(ev, 3)


def _pub(path: str) -> tuple[zmq.Context, zmq.Socket]:
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUB)
    s.setsockopt(zmq.LINGER, 0)
    s.bind(path)
    return ctx, s


def _send(sock: zmq.Socket, seq: int, events: list) -> None:
    sock.send_multipart([b"", seq.to_bytes(8, "big"), codec.pack([time.time(), events, 0])])


def _wait(pred, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_the_router_ends_with_what_the_relay_mirrors_through_gaps_and_hostile_frames(tmp_path):
    folder = tempfile.mkdtemp(prefix="kvb-t-")
    source = f"ipc://{folder}/ev"
    settings = {"secret": SECRET.hex(), "incarnation": "p-a-1", "host": "127.0.0.1",
                "endpoint_file": os.path.join(folder, "kv-events.json")}
    relay = VllmKvRelay(settings, source, "tiny", BS)
    ctx, pub = _pub(source)
    client = KvEventsClient(KvIndex(), SECRET, replay_timeout_s=10)
    try:
        with open(settings["endpoint_file"]) as f:
            client.sync_worker("p-a", {**json.load(f), "incarnation": "p-a-1"})
        _wait(lambda: client.synced("p-a"), "the first dump")
        seq = 0
        while relay.stats["batches"] == 0:  # until the relay's subscription is up (a PUB drops before that)
            seq += 1
            _send(pub, seq, [])
            time.sleep(0.05)
            assert seq < 600, "the relay never received a batch"
        toks = list(range(100, 124))
        for ev in ([_stored([1, 2], None, toks[:8])], [_stored([3], 2, toks[8:12])]):
            seq += 1
            _send(pub, seq, ev)
        want = dict.fromkeys(chain_keys(FP, toks[:12], BS))
        _wait(lambda: set(client.index.blocks_of("p-a")) == set(want), "three blocks indexed")
        pub.send_multipart([b"", b"short"])                           # hostile frames: counted, skipped
        pub.send_multipart([b"", (seq + 1).to_bytes(8, "big"), b"\xc1not msgpack"])
        _wait(lambda: relay.stats["rejected"] == 2, "two frames refused")
        assert len(relay.mirror) == 0  # a refused batch may be half applied: the relayed cache restarts
        _wait(lambda: client.index.blocks_of("p-a") == {}, "the router told so")
        _send(pub, seq + 2, [_stored([9], None, toks[12:16])])
        _send(pub, seq + 7, [_stored([10], None, toks[16:20])])       # four lost: the relay starts over
        _wait(lambda: relay.stats["gaps"] == 1 and len(relay.mirror) == 1, "the gap seen")
        last = chain_keys(FP, toks[16:20], BS)
        _wait(lambda: list(client.index.blocks_of("p-a")) == last, "the index equal to the relay's mirror")
        assert client.stats["rejected"] == 0
    finally:
        client.close()
        relay.close()
        pub.close(0)
        ctx.term()
        assert root_key(FP)  # (a fingerprint kv_events.check_deterministic accepts: the relay started)


class _VllmReplay:
    """vLLM's replay socket, standing in (fault injection: real vLLM drops no batch on demand): a ROUTER that
    answers [b"", start] with every buffered batch from `start` on, then vLLM's end marker (seq -1)."""

    def __init__(self, ctx: zmq.Context, path: str) -> None:
        self.buffer: list[tuple[int, bytes]] = []
        self.silent = False
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(path)

    def serve_once(self) -> bool:
        if not self.sock.poll(20):
            return False
        client, _, start = self.sock.recv_multipart()
        if self.silent:
            return True
        for seq, payload in self.buffer:
            if seq >= int.from_bytes(start, "big"):
                self.sock.send_multipart([client, b"", b"", seq.to_bytes(8, "big"), payload])
        self.sock.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])
        return True


def test_a_gap_is_filled_from_vllms_replay_and_its_copies_skipped_else_the_cache_starts_over(monkeypatch):
    import threading

    from kvbridge.serving import vllm_kv_relay

    monkeypatch.setattr(vllm_kv_relay, "REPLAY_TIMEOUT_S", 0.5)
    folder = tempfile.mkdtemp(prefix="kvb-t-")
    source, replay = f"ipc://{folder}/ev", f"ipc://{folder}/replay"
    settings = {"secret": SECRET.hex(), "incarnation": "p-a-1", "host": "127.0.0.1",
                "endpoint_file": os.path.join(folder, "kv-events.json")}
    relay = VllmKvRelay(settings, source, "tiny", BS, replay)
    ctx, pub = _pub(source)
    vllm = _VllmReplay(ctx, replay)
    stop = threading.Event()
    def serve() -> None:
        while not stop.is_set():
            vllm.serve_once()

    server = threading.Thread(target=serve, daemon=True)
    server.start()

    def batch(seq: int, events: list, sent: bool = True, kept: bool = True) -> None:
        payload = codec.pack([time.time(), events, 0])
        if kept:
            vllm.buffer.append((seq, payload))
        if sent:
            pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    try:
        seq = 0
        while relay.stats["batches"] == 0:  # until the relay's subscription is up (a PUB drops before that)
            seq += 1
            batch(seq, [])
            time.sleep(0.05)
            assert seq < 600, "the relay never received a batch"
        _wait(lambda: relay._last_seq == seq, "the warm-up batches")
        toks = list(range(100, 124))
        batch(seq + 1, [_stored([1, 2], None, toks[:8])])
        batch(seq + 2, [_stored([3], 2, toks[8:12])], sent=False)        # dropped on the way to the relay
        batch(seq + 3, [_stored([4], 3, toks[12:16])], sent=False)       # not yet sent when the gap is seen
        batch(seq + 4, [_stored([5], 4, toks[16:20])], sent=False)
        pub.send_multipart([b"", (seq + 3).to_bytes(8, "big"), vllm.buffer[-2][1]])   # the gap: 2 missing
        _wait(lambda: relay.stats["replayed"] == 3, "batches seq+2 .. seq+4 replayed")
        pub.send_multipart([b"", (seq + 4).to_bytes(8, "big"), vllm.buffer[-1][1]])   # its copy, late
        batch(seq + 5, [_stored([6], 5, toks[20:24])])
        _wait(lambda: relay.stats["duplicates"] == 1 and len(relay.mirror) == 6, "the copy skipped, 6 blocks")
        assert relay.stats["gaps"] == 0
        assert [k for k, _p, _n in relay.mirror.snapshot()] == chain_keys(FP, toks, BS)
        batch(seq + 6, [_stored([7], None, toks[:4])], sent=False, kept=False)  # gone from vLLM's buffer too
        batch(seq + 7, [_stored([8], None, toks[4:8])])
        _wait(lambda: relay.stats["gaps"] == 1 and len(relay.mirror) == 1, "no replay: the cache starts over")
        vllm.silent = True                                                 # a replay that never answers
        batch(seq + 9, [_stored([9], None, toks[8:12])])
        _wait(lambda: relay.stats["gaps"] == 2 and len(relay.mirror) == 1, "a silent replay: bounded, over")
        vllm.silent = False
        batch(seq + 10, [_stored([10], 9, toks[12:16])], sent=False)
        batch(seq + 11, [_stored([11], 10, toks[16:20])])                 # replayed over a new socket
        _wait(lambda: relay.stats["replayed"] == 5 and len(relay.mirror) == 3, "the next gap filled")
        assert relay.stats["gaps"] == 2 and relay.stats["rejected"] == 0
    finally:
        stop.set()
        server.join(5)
        relay.close()
        pub.close(0)
        vllm.sock.close(0)
        ctx.term()
