"""The spine: a context process's pool pulled by a generation process through ZeroMQ + NIXL, byte-exact."""

from __future__ import annotations

import numpy as np
import pytest
import zmq

from kvbridge.codec import pack
from kvbridge.formatter.layout import KVLayout, KVShape
from kvbridge.transceiver import messages as m

from .ranks import Cluster

LAYOUT = KVLayout(KVShape(num_layers=4, num_kv_heads=4, head_dim=16, dtype="bfloat16", tokens_per_block=16))
CTX_BLOCKS, GEN_BLOCKS = 400, 480


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(2)
    # generous silence bounds: on a loaded 2-core box the harness itself can hold a rank's GIL for seconds
    c.setup(LAYOUT, LAYOUT, CTX_BLOCKS, GEN_BLOCKS, {"agents": ["nixl"], "lease_s": 30.0, "heartbeat_s": 0.5,
                                                    "peer_timeout_s": 30.0})
    yield c
    c.close()


def _requests(rng, count, first_rid, ctx_free, gen_free):
    """`count` requests of varied lengths with scattered ctx and gen block ids (taken from the free lists)."""
    reqs, pulls = [], []
    for i in range(count):
        n = int(rng.integers(1, 400))
        nb = -(-n // 16)
        cb, gb = [ctx_free.pop() for _ in range(nb)], [gen_free.pop() for _ in range(nb)]
        rid = first_rid + i
        reqs.append((rid, cb, n, rid))
        pulls.append([rid, None, gb, n, rid])
    return reqs, pulls


def test_twenty_requests_of_varied_lengths_move_every_byte(cluster):
    rng = np.random.default_rng(42)
    ctx_free = list(rng.permutation(CTX_BLOCKS - 40))  # the top 40 blocks are kept for the checks below
    gen_free = list(rng.permutation(GEN_BLOCKS - 40))
    reqs, pulls = _requests(rng, 20, 1000, ctx_free, gen_free)
    cluster.publish(reqs)
    assert cluster.ctx_status()[0]["pinned"] == 20
    for p in pulls:
        p[1] = cluster.params(p[0])
    (ans,) = cluster.pull(pulls)
    bad = [r for r in ans["results"] if not r["ok"]]
    assert not bad, bad
    assert len(ans["results"]) == 20, ans["results"]
    assert ans["mismatched_bytes"] == 0  # the whole generation pool: 20 requests in place, the rest untouched
    st = cluster.wait_ctx_released()
    assert st[0]["pinned"] == 0
    done = {rid: status for rid, status, _ in st[0]["finished"]}
    assert all(done[r[0]] == "complete" for r in reqs)


def _raw_dealer(endpoint: str) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    return s


def _answer(sock: zmq.Socket, frame: bytes) -> m.Message:
    sock.send(frame)
    assert sock.poll(5000), "no answer within 5 s"
    return m.decode(sock.recv())


def _assert_still_serving(cluster, rid):
    """A normal request still goes through end to end after the bad input."""
    reqs = [(rid, [CTX_BLOCKS - 1 - (rid % 20)], 7, rid)]
    cluster.publish(reqs)
    (ans,) = cluster.pull([[rid, cluster.params(rid), [GEN_BLOCKS - 1 - (rid % 20)], 7, rid]])
    assert ans["results"][0]["ok"], ans["results"]
    assert ans["mismatched_bytes"] == 0


def test_wrong_protocol_version_gets_a_clear_error(cluster):
    sock = _raw_dealer(cluster.endpoints[0])
    ans = _answer(sock, pack({"v": 99, "t": "hello", "gen_instance": "x"}))
    assert isinstance(ans, m.Error) and ans.code == "version"
    assert "protocol version 99" in ans.message and f"speaks {m.PROTOCOL_VERSION}" in ans.message
    sock.close()
    _assert_still_serving(cluster, 5001)


def test_truncated_frame_gets_a_clear_error(cluster):
    sock = _raw_dealer(cluster.endpoints[0])
    frame = m.Hello("raw", 0, LAYOUT.to_wire(), ["nixl"]).encode()
    ans = _answer(sock, frame[: len(frame) // 2])
    assert isinstance(ans, m.Error) and ans.code == "malformed"
    assert "truncated" in ans.message or "malformed" in ans.message
    ans = _answer(sock, pack({"v": m.PROTOCOL_VERSION, "t": "fetch", "ctx_request_id": "seven", "gen_rank": 0}))
    assert ans.code == "malformed" and "'ctx_request_id' should be int" in ans.message
    sock.close()
    _assert_still_serving(cluster, 5002)


def test_unknown_request_id_fails_the_pull_with_its_reason(cluster):
    (ans,) = cluster.pull([[777777, cluster.params(777777), [GEN_BLOCKS - 30], 5, 1]])
    r = ans["results"][0]
    assert not r["ok"] and r["error_type"] == "RequestNotFound"
    assert "has no request 777777" in r["error"]
    assert ans["mismatched_bytes"] == 0 and ans["failed_written_bytes"] == 0  # nothing was written
    _assert_still_serving(cluster, 5003)


def test_mismatched_layout_is_refused_with_both_layouts_shown(cluster):
    other = KVLayout(KVShape(num_layers=4, num_kv_heads=4, head_dim=32, dtype="bfloat16", tokens_per_block=16))
    sock = _raw_dealer(cluster.endpoints[0])
    ans = _answer(sock, m.Hello("raw-mismatch", 0, other.to_wire(), ["nixl"]).encode())
    assert isinstance(ans, m.Error) and ans.code == "layout_mismatch"
    assert "head_dim (context 16, generation 32)" in ans.message
    assert "context layout:" in ans.message and "generation layout:" in ans.message
    sock.close()
    _assert_still_serving(cluster, 5004)


def test_a_generation_rank_with_another_mapping_version_is_refused(cluster):
    sock = _raw_dealer(cluster.endpoints[0])
    ans = _answer(sock, m.Hello("old-gen", 0, LAYOUT.to_wire(), ["nixl"], "", 1).encode())
    assert isinstance(ans, m.Error) and ans.code == "layout_mismatch"
    assert "mapping version: context 2, generation 1" in ans.message
    sock.close()
    _assert_still_serving(cluster, 5005)
