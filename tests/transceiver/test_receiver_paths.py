"""Generation-side error paths no other test reaches, between real rank processes (ZeroMQ + a real agent); the
fault is injected only where it happens. Each checks the error text, that detection is bounded by the
configured timeouts, and that both sides end with nothing pinned, no arena slot taken and every byte outside
the failed pull's blocks as it was; then a following request succeeds.

    duplicate request id     a second pull under an id still in flight is refused at once; the first goes on
    staged slot outside      a Blocks reply naming a packed slot outside the context rank's arena (or not
                             the piece's size)
    unpack / hash failure    the worker thread's unpack (staged) or hash (verify mode) raises
    reads that never settle  an agent whose reads ignore cancel: the failed pull is reported only once they
                             settle (blocks held meanwhile), or after quarantine_s at the latest
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import zmq

from kvbridge.formatter.layout import KVLayout, KVShape
from kvbridge.transceiver import messages as m

from .fault_ranks import GATED, FaultyRankProc
from .ranks import Cluster, RankProc

LAYOUT = KVLayout(KVShape(num_layers=4, num_kv_heads=2, head_dim=16, dtype="float16", tokens_per_block=16))
FAST = {"agents": ["nixl"], "lease_s": 2.0, "heartbeat_s": 0.25, "peer_timeout_s": 3.0,
        "pickup_timeout_s": 3.0,
        "handshake_timeout_s": 1.0, "transfer_timeout_s": 20.0, "drain_timeout_s": 1.0}
pytestmark = pytest.mark.alone  # FAST: handshakes of 1 s, leases of 2 s (tests/conftest.py)
# staged whenever a piece is 2+ fragments (non-adjacent blocks): every pull below goes through the arenas
STAGED = {**FAST, "staging_arena_bytes": 1 << 20, "staging_min_fragments": 2,
          "staging_threshold_bytes": 1 << 20}
NB = 32


def _cluster(procs, config) -> Cluster:
    c = Cluster(0)
    c.procs = procs
    c.setup(LAYOUT, LAYOUT, NB, NB, config)
    return c


@pytest.fixture
def plain():
    c = _cluster([RankProc(), RankProc()], FAST)
    yield c
    c.close()


def _finished(c, rid):
    return [(status, detail) for r, status, detail in c.ctx_status()[0]["finished"] if r == rid]


def _wait(what: str, cond, timeout: float):
    """cond()'s first truthy value, polled until `timeout` seconds (then the test fails naming `what`)."""
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.02)
    return got


def _released(c, rid, timeout=5.0):
    f = _wait(f"context request {rid} finished", lambda: _finished(c, rid), timeout)
    assert c.wait_ctx_released()[0]["pinned"] == 0
    assert all(p.call("arena_in_use") in (0, None) for p in c.ctx + c.gen)
    return f


def _next_request_succeeds(c, rid, ctx_blocks, gen_blocks, params=None):
    c.publish([(rid, ctx_blocks, 20, rid)])
    (ans,) = c.pull([[rid, params or c.params(rid), gen_blocks, 20, rid]])
    assert ans["results"][0]["ok"], ans["results"]
    assert ans["mismatched_bytes"] == 0
    assert _released(c, rid) == [("complete", "all readers confirmed")]


def test_a_second_pull_under_an_id_in_flight_is_refused_at_once_and_the_first_goes_on(plain):
    c = plain
    c.ctx[0].call("publish_streaming", [(1, [0, 1], 20, 1)])  # no layer ready: the first pull stays in flight
    c.gen[0].call("submit", {"pulls": [[1, c.params(1), [0, 1], 20, 1]]})
    _wait("the first pull's fetch", lambda: c.ctx_status()[0]["fetches"] >= 1, 5.0)
    c.gen[0].call("submit", {"pulls": [[1, c.params(1), [4, 5], 20, 1]]})  # the same id, other blocks
    # the first goes on: still in flight, its context request still pinned
    assert c.gen[0].call("gen_status")["in_flight"] == 1 and c.ctx_status()[0]["pinned"] == 1
    c.gen[0].call("cancel", 1)
    _wait("the first pull reported", lambda: c.gen[0].call("gen_status")["in_flight"] == 0, 5.0)
    ans = c.gen[0].call("collect", {"timeout": 5})
    dup, first = ans["results"]  # the refusal came first: at submit, while the first pull was in flight
    assert not dup["ok"] and dup["error_type"] == "TransceiverError", dup
    assert dup["error"] == "request 1 is already being pulled"
    assert not first["ok"] and first["error_type"] == "RequestCancelled", first
    assert ans["mismatched_bytes"] == 0  # nothing outside blocks 4, 5 changed: the first pull's 0, 1 neither
    assert ans["failed_written_bytes"] == 0  # the refused pull wrote nothing into its blocks
    assert _released(c, 1) == [("failed", "a generation rank reported a failed read")]
    _next_request_succeeds(c, 2, [4, 6], [0, 2])


class _Proxy:
    """A ZeroMQ relay between generation ranks and one context rank that passes every staged Blocks reply
    through `rewrite(welcome, blocks) -> blocks` (the only fault; every other frame passes as is)."""

    def __init__(self, endpoint: str) -> None:
        self.zctx = zmq.Context()
        self.front = self.zctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 0)
        self.front.bind("tcp://127.0.0.1:0")
        self.endpoint = self.front.getsockopt_string(zmq.LAST_ENDPOINT)
        self.target, self.backs, self.sent = endpoint, {}, []
        self.rewrite = lambda _w, b: b
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _back(self, ident: bytes):
        if ident not in self.backs:
            s = self.zctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(self.target)
            self.backs[ident] = s
        return self.backs[ident]

    def _run(self) -> None:
        welcome = None
        while not self.stop.is_set():
            poller = zmq.Poller()
            for s in (self.front, *self.backs.values()):
                poller.register(s, zmq.POLLIN)
            for s, _ in poller.poll(50):
                if s is self.front:  # one message may carry several frames (a loop turn's batch)
                    ident, *frames = s.recv_multipart()
                    self._back(ident).send_multipart(frames)
                    continue
                out = []
                for frame in s.recv_multipart():
                    msg = m.decode(frame)
                    if isinstance(msg, m.Welcome):
                        welcome = msg
                    elif isinstance(msg, m.Blocks) and msg.staging_addr >= 0:
                        msg = self.rewrite(welcome, msg)
                        self.sent.append(msg)
                        frame = msg.encode()
                    out.append(frame)
                ident = next(i for i, b in self.backs.items() if b is s)
                self.front.send_multipart([ident, *out])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        for s in (self.front, *self.backs.values()):
            s.close(0)
        self.zctx.term()


def _end(w: m.Welcome) -> int:
    return w.staging_base + w.staging_bytes


BAD_SLOTS = {  # how the staged reply is wrong: a slot that is not (all) in the context rank's arena, or not
    # the size of the piece the generation rank asked for
    "past_the_end": lambda w, b: dataclasses.replace(b, staging_addr=_end(w)),
    "before_the_base": lambda w, b: dataclasses.replace(b, staging_addr=w.staging_base - b.staging_bytes),
    "across_the_end": lambda w, b: dataclasses.replace(b, staging_addr=_end(w) - b.staging_bytes // 2),
    "wrong_size": lambda w, b: dataclasses.replace(b, staging_bytes=b.staging_bytes - 64),
}


def test_a_staged_slot_outside_the_context_arena_or_of_the_wrong_size_fails_the_pull_and_frees_both_slots():
    c = _cluster([RankProc(), RankProc()], STAGED)
    proxy = _Proxy(c.endpoints[0])
    try:
        for rid, (name, rewrite) in enumerate(BAD_SLOTS.items(), start=3):
            proxy.rewrite = rewrite
            c.publish([(rid, [0, 2], 20, rid)])
            params = {**c.params(rid), "endpoints": [proxy.endpoint]}
            t0 = time.monotonic()
            (ans,) = c.pull([[rid, params, [1, 3], 20, rid]])
            took = time.monotonic() - t0
            r, sent = ans["results"][0], proxy.sent[-1]
            assert not r["ok"] and r["error_type"] == "ProtocolError", (name, r)
            assert r["error"] == (f"context rank 0 staged {sent.staging_bytes} bytes at "
                                  f"{sent.staging_addr:#x}, "
                                  f"outside its arena or not the piece's size"), (name, r)
            assert took < FAST["handshake_timeout_s"] + FAST["drain_timeout_s"] + 2.0, f"{name}: {took:.2f} s"
            assert ans["mismatched_bytes"] == 0 and ans["failed_written_bytes"] == 0, name  # nothing was read
            assert _released(c, rid) == [("failed", "a generation rank reported a failed read")], name
        assert len(proxy.sent) == len(BAD_SLOTS)
        _next_request_succeeds(c, 20, [4, 6], [1, 3])  # straight to the context rank: staged and exact
    finally:
        proxy.close()
        c.close()


@pytest.mark.parametrize("breaks, config", [("hash", {**FAST, "verify": True}), ("unpack", STAGED)])
def test_a_failing_unpack_or_hash_fails_the_pull_naming_it_and_frees_everything(breaks, config):
    c = _cluster([RankProc(), FaultyRankProc(breaks=breaks)], config)
    try:
        c.publish([(5, [0, 2], 20, 5)])
        t0 = time.monotonic()
        (ans,) = c.pull([[5, c.params(5), [1, 3], 20, 5]])
        took = time.monotonic() - t0
        r = ans["results"][0]
        assert not r["ok"] and r["error_type"] == "TransferFailed", r
        assert r["error"] == ("unpacking or hashing the received KV failed: injected fault: the "
                              f"{breaks} step raised")
        assert took < config["transfer_timeout_s"], f"failed after {took:.2f} s"
        assert ans["mismatched_bytes"] == 0  # the failed pull's blocks aside, the pool is as it was
        assert _released(c, 5) == [("failed", "a generation rank reported a failed read")]
    finally:
        c.close()


@pytest.fixture
def gated(tmp_path):
    """Context and generation ranks on GatedAgent ("cma"); reads settle once the gate file exists."""
    gate = tmp_path / "reads-may-settle"
    cfg = {**FAST, "agents": ["cma"], "drain_timeout_s": 0.5, "quarantine_s": 2.0,
           "options": {"cma": {"gate": str(gate)}}}
    c = _cluster([FaultyRankProc({"cma": GATED}), FaultyRankProc({"cma": GATED})], cfg)
    yield c, gate, cfg
    c.close()


def _pending_read(c, rid, gen_blocks):
    """Publish `rid`, submit its pull, and wait until its read was posted (its bytes landed; the handle is
    still PENDING behind the gate)."""
    c.publish([(rid, [0, 1], 20, rid)])
    c.gen[0].call("submit", {"pulls": [[rid, c.params(rid), gen_blocks, 20, rid]]})
    every = list(range(LAYOUT.local_layers(0)))
    _wait("the read posted", lambda: c.gen[0].call("arrived_layers", (gen_blocks, 20, rid)) == every, 5.0)


def test_a_cancelled_read_that_does_not_stop_holds_its_blocks_until_it_settles(gated):
    c, gate, cfg = gated
    _pending_read(c, 7, [0, 1])
    c.gen[0].call("cancel", 7)
    t0 = time.monotonic()
    while time.monotonic() - t0 < cfg["drain_timeout_s"] + 0.5:  # past the drain deadline: quarantined
        assert c.gen[0].call("gen_status")["in_flight"] == 1, "reported while its read could still land"
        time.sleep(0.05)
    assert c.ctx_status()[0]["pinned"] == 0  # the context side was told at the drain deadline
    assert _finished(c, 7) == [("failed", "a generation rank reported a failed read")]
    gate.touch()  # the read settles now: only then is the pull reported
    ans = c.gen[0].call("collect", {"timeout": 5})
    r = ans["results"][0]
    assert not r["ok"] and r["error_type"] == "RequestCancelled"
    assert r["error"] == "request 7 was cancelled on the generation side"
    _next_request_succeeds(c, 8, [2, 3], [0, 1])  # the same generation blocks, reused after the report


def test_reads_that_never_settle_are_released_after_quarantine_s(gated):
    c, gate, cfg = gated
    _pending_read(c, 9, [0, 1])
    t0 = time.monotonic()
    c.gen[0].call("cancel", 9)
    ans = c.gen[0].call("collect", {"timeout": 30})  # the gate stays shut: quarantine_s decides
    took = time.monotonic() - t0
    r = ans["results"][0]
    assert not r["ok"] and r["error_type"] == "RequestCancelled"
    floor = cfg["drain_timeout_s"] + cfg["quarantine_s"]
    assert floor <= took < floor + 2.0, f"reported after {took:.2f} s"
    assert c.gen[0].call("gen_status")["in_flight"] == 0
    assert _released(c, 9) == [("failed", "a generation rank reported a failed read")]
    gate.touch()
    _next_request_succeeds(c, 10, [2, 3], [4, 5])
