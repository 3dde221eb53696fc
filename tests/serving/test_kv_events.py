"""KV events end to end on real executors (rank processes, real ZeroMQ with ZAP, real prefix caches): the
router-side index (kv_index.py, fed by kv_subscriber.py) equals what each worker's cache holds; a lost range
of events is repaired from the replay socket; a restarted worker (new incarnation) is dumped again and its
old blocks dropped; a stream nobody of the deployment signed changes nothing; a subscriber without the token
is refused at the handshake; block hashes are the same in every process (and equal the reference vector)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import pytest
import zmq
from kvbridge.errors import ProtocolError
from kvbridge.executor.kv_events import (
    REFERENCE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    derive_secret,
    encode_batch,
    make_topic,
    parse_topic,
    subscriber_password,
)
from kvbridge.kvcache.prefix_tree import chain_keys
from kvbridge.executor.runtime import Executor, ExecutorConfig
from kvbridge.serving.kv_index import KvIndex
from kvbridge.serving.kv_subscriber import KvEventsClient
from zmq.utils.monitor import recv_monitor_message

MODEL = "seeded:tiny3"
SECRET = derive_secret("the-deployment-token")
TPB, BLOCKS = 4, 24


def _executor(tmp_path, incarnation: str) -> tuple[Executor, dict]:
    ef = os.path.join(str(tmp_path), f"{incarnation}.json")
    ex = Executor.start(ExecutorConfig(model=MODEL, num_blocks=BLOCKS, tokens_per_block=TPB, timeout_s=120,
                                       enable_block_reuse=True,
                                       kv_events={"secret": SECRET.hex(), "incarnation": incarnation,
                                                  "host": "127.0.0.1", "endpoint_file": ef}))
    deadline = time.monotonic() + 60
    while not os.path.exists(ef):
        assert time.monotonic() < deadline, "the leader never wrote its KV event endpoints"
        time.sleep(0.05)
    with open(ef) as f:
        return ex, {**json.load(f), "incarnation": incarnation}


def _dump(client: KvEventsClient, name: str, tries: int = 3) -> dict:
    """The worker's full dump; asked again (bounded: `tries` x the client's 10 s) when an answer is late on a
    loaded machine (a full make test run saw one)."""
    for _ in range(tries):
        got = client._ask(client._conns[name], {"op": "dump"})
        if got is not None:
            return got
    raise AssertionError(f"{name} answered no dump in {tries} tries")


def _wait_equal(client: KvEventsClient, name: str, timeout: float = 60) -> dict:
    """Poll (bounded) until the index's blocks of `name` equal the worker's own dump at the same seq."""
    deadline = time.monotonic() + timeout
    while True:
        d = _dump(client, name)
        truth = {bytes(b[0]): b[1] for b in d["blocks"]}
        if client.last_seq(name) == d["seq"] and client.index.blocks_of(name) == truth:
            return d
        assert time.monotonic() < deadline, (f"index of {name}: {len(client.index.blocks_of(name))} blocks at "
                                             f"seq {client.last_seq(name)}; worker: {len(truth)} at {d['seq']}")
        time.sleep(0.1)


def _wait(pred, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _prompts(rng: random.Random, n: int) -> list[list[int]]:
    shared = [rng.randrange(1, 200) for _ in range(12)]
    out = []
    for _ in range(n):
        head = shared[:rng.choice((0, 4, 8, 12))]
        out.append(head + [rng.randrange(1, 200) for _ in range(rng.randrange(2, 20))])
    return out


@pytest.fixture
def client():
    c = KvEventsClient(KvIndex(), SECRET, replay_timeout_s=10)
    yield c
    c.close()


def test_index_equals_the_workers_cache_after_a_randomized_run_with_evictions(tmp_path, client):
    ex, info = _executor(tmp_path, "w0-a")
    with ex:
        client.sync_worker("w0", info)
        _wait(lambda: client.synced("w0"), "the first dump")
        rng = random.Random(26)
        stored = 0
        for _ in range(6):
            batch = _prompts(rng, 4)
            ex.generate(batch, max_tokens=5, timeout=120)
            stored += sum((len(p) + 5) // TPB for p in batch)
        assert stored > 2 * BLOCKS  # far more blocks were cached than the pool holds: evictions happened
        d = _wait_equal(client, "w0")
        assert d["blocks"] and client.stats["batches"] > 0 and client.stats["rejected"] == 0


def test_a_lost_range_of_events_is_replayed_and_the_index_catches_up(tmp_path, client):
    ex, info = _executor(tmp_path, "w0-b")
    with ex:
        client.sync_worker("w0", info)
        _wait(lambda: client.synced("w0"), "the first dump")
        base = client.last_seq("w0")
        client.drop_seqs["w0"] = set(range(base + 1, base + 4))  # fault injection: lost on the network
        rng = random.Random(3)
        for _ in range(4):
            ex.generate(_prompts(rng, 2), max_tokens=4, timeout=120)
        _wait_equal(client, "w0")
        assert client.stats["gaps_repaired"] >= 1


def test_a_restarted_worker_is_dumped_again_and_its_old_blocks_dropped(tmp_path, client):
    ex, info = _executor(tmp_path, "w0-c1")
    with ex:
        client.sync_worker("w0", info)
        ex.generate([list(range(1, 30))], max_tokens=3, timeout=120)
        _wait_equal(client, "w0")
        old = set(client.index.blocks_of("w0"))
        assert old
    ex2, info2 = _executor(tmp_path, "w0-c2")  # the same worker, started again: a new incarnation
    with ex2:
        client.sync_worker("w0", info2)
        _wait(lambda: client.synced("w0") and client.index.info("w0").incarnation == "w0-c2", "the new dump")
        assert not old & set(client.index.blocks_of("w0"))
        ex2.generate([list(range(100, 117))], max_tokens=3, timeout=120)
        _wait_equal(client, "w0")


def test_a_forged_stream_changes_nothing_and_is_counted(client):
    from zmq.auth.thread import ThreadAuthenticator

    ctx = zmq.Context()
    auth = ThreadAuthenticator(ctx)  # a forger who sniffed the subscriber password (PLAIN sends it in clear)
    auth.start()                     # but does not know the deployment's token, so cannot sign
    auth.configure_plain(domain="kvbridge-kv", passwords={"kvbridge": subscriber_password(SECRET).decode()})
    pub, rep = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    for s in (pub, rep):
        s.plain_server = True
        s.zap_domain = b"kvbridge-kv"
        s.setsockopt(zmq.LINGER, 0)
    pub_port, rep_port = pub.bind_to_random_port("tcp://127.0.0.1"), rep.bind_to_random_port("tcp://127.0.0.1")
    forged = derive_secret("not-the-token")
    try:
        client.sync_worker("w9", {"pub": f"tcp://127.0.0.1:{pub_port}", "replay": f"tcp://127.0.0.1:{rep_port}",
                                  "incarnation": "w9-x"})
        payload = encode_batch(KVEventBatch(time.time(), (BlockStored((b"\1" * 16,), None, (1, 2, 3, 4), 4),)))
        deadline = time.monotonic() + 60
        seq = 0
        while client.stats["rejected"] < 3:
            assert time.monotonic() < deadline, client.stats
            if rep.poll(50):
                ident, _, _req = rep.recv_multipart()
                from kvbridge import codec

                body = codec.pack({"v": 1, "incarnation": "w9-x", "op": "dump", "seq": 5, "fingerprint": "f",
                                   "block_size": 4, "blocks": [[b"\1" * 16, None, 4]]})
                rep.send_multipart([ident, b"", body, b"\0" * 32])
            seq += 1
            pub.send_multipart([make_topic(forged, "w9-x", seq, payload), seq.to_bytes(8, "big"), payload])
        assert client.index.blocks_of("w9") == {} and not client.synced("w9")
    finally:
        pub.close(0)
        rep.close(0)
        auth.stop()
        ctx.term()


def test_a_subscriber_without_the_token_is_refused_at_the_handshake(tmp_path):
    ex, info = _executor(tmp_path, "w0-d")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        with ex:
            mon = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_SUCCEEDED)
            sub.plain_username, sub.plain_password = b"kvbridge", b"guess"
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(info["pub"])
            assert mon.poll(30000), "no handshake outcome within 30 s"
            assert recv_monitor_message(mon)["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH
            sub.disable_monitor()
            mon.close(0)
    finally:
        sub.close(0)
        ctx.term()


def test_block_hashes_are_the_same_in_two_processes_and_equal_the_reference_vector(tmp_path, client):
    fp, toks, tpb, want = REFERENCE
    code = ("import sys; from kvbridge.kvcache.prefix_tree import chain_keys; "
            "print(','.join(k.hex() for k in chain_keys(sys.argv[1], list(range(40)), 4)))")
    outs = []
    for seed in ("1", "2"):  # a different Python hash seed each: Python's hash() would differ
        r = subprocess.run([sys.executable, "-c", code, "fp"], capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, PYTHONHASHSEED=seed), check=False)
        assert r.returncode == 0, r.stderr
        outs.append(r.stdout.strip())
    assert outs[0] == outs[1] == ",".join(k.hex() for k in chain_keys("fp", list(range(40)), 4))
    assert tuple(k.hex() for k in chain_keys(fp, toks, tpb)) == want
    ex, info = _executor(tmp_path, "w0-e")  # and a worker's events carry exactly the keys we compute here
    with ex:
        client.sync_worker("w0", info)
        prompt = list(range(7, 7 + 4 * TPB + 2))
        ex.generate([prompt], max_tokens=2, timeout=120)
        _wait_equal(client, "w0")
        keys = client.index.keys_for("w0", prompt)
        assert len(keys) == 4 and client.index.match("w0", keys) == (4, 4)


def test_event_batches_round_trip_in_vllm_shape_and_bad_fields_are_named():
    b = KVEventBatch(1.5, (BlockStored((b"a" * 16, b"b" * 16), None, tuple(range(8)), 4, None, "CPU"),
                           BlockRemoved((b"c" * 16,), "CPU"), AllBlocksCleared()))
    raw = encode_batch(b)
    assert decode_batch(raw) == b
    from kvbridge import codec

    w = codec.unpack(raw)
    assert w[1][0]["type"] == "BlockStored" and w[1][2] == {"type": "AllBlocksCleared"} and w[2] is None
    w[1][0]["token_ids"] = [1, 2]  # token_ids no longer cover the blocks
    with pytest.raises(ProtocolError, match=r"events\[0\]\.token_ids"):
        decode_batch(codec.pack(w))
    topic = make_topic(SECRET, "inc", 7, raw)
    assert parse_topic(SECRET, topic, (7).to_bytes(8, "big"), raw) == ("inc", 7)
    with pytest.raises(ProtocolError, match="bad signature"):
        parse_topic(SECRET, topic, (8).to_bytes(8, "big"), raw)


def test_the_index_is_bounded_and_speculative_entries_expire():
    idx = KvIndex(max_entries=5, spec_ttl_s=0.0)
    idx.add_worker("a", "fp", 4, "i")
    keys = chain_keys("fp", list(range(40)), 4)
    idx.apply("a", 1, KVEventBatch(0.0, (BlockStored(tuple(keys[:8]), None, tuple(range(32)), 4),)))
    assert idx.size == 5 and idx.evicted == 3
    idx.speculate("a", keys)
    assert idx.match("a", keys) == (0, 0)  # the oldest (leading) entries went first; ttl 0: no speculation
    idx2 = KvIndex(spec_ttl_s=60)
    idx2.add_worker("a", "fp", 4, "i")
    idx2.speculate("a", keys[:3])
    assert idx2.match("a", keys) == (0, 3)
    idx2.remove_worker("a")
    assert idx2.match("a", keys) == (0, 0) and idx2.size == 0


def test_a_worker_whose_hashes_would_not_be_deterministic_refuses_naming_why():
    from kvbridge.errors import ExecutorError
    from kvbridge.executor.kv_events import check_deterministic

    check_deterministic("layout-fp:seeded:tiny3")
    with pytest.raises(ExecutorError, match="not the same in every process"):
        check_deterministic("layout-fp:<model object at 0x7f00>")
    with pytest.raises(ExecutorError, match="needs the layout and a model id"):
        check_deterministic("layout-fp:")


def test_vllms_own_decoder_reads_our_event_batches(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    py = os.path.join(root, ".venv-vllm", "bin", "python")
    if not os.path.exists(py):
        pytest.skip("no vLLM environment (.venv-vllm) on this machine")
    path = str(tmp_path / "batch.bin")
    with open(path, "wb") as f:
        f.write(encode_batch(KVEventBatch(1.0, (BlockStored((b"a" * 16,), None, (1, 2, 3, 4), 4, None, "CPU"),
                                                BlockRemoved((b"a" * 16,), "CPU"), AllBlocksCleared()))))
    code = ("import sys, msgspec; from vllm.distributed.kv_events import KVEventBatch; "
            "b = msgspec.msgpack.Decoder(type=KVEventBatch).decode(open(sys.argv[1], 'rb').read()); "
            "print([type(e).__name__ for e in b.events], b.events[0].token_ids, b.events[0].block_hashes)")
    r = subprocess.run([py, "-c", code, path], capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                       check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == \
        "['BlockStored', 'BlockRemoved', 'AllBlocksCleared'] [1, 2, 3, 4] [b'aaaaaaaaaaaaaaaa']"
