"""Read-ahead: a generation rank whose DisaggParams carry the context block ids posts its reads with its Fetch
(no Blocks round trip), between real rank processes (ZeroMQ + NIXL). A relay between the ranks records every
frame's type, so "one round trip fewer" is checked on the wire, not by timing.

    vouched for     a request published complete under a secret the context rank made: the pull is
                    byte-exact, the context rank answers Hello and Done only (no Blocks), and completes
    refused         a caller-chosen secret, a streamed publish, other block ids: the pull fails with
                    ReadAheadRefused naming the reason, the context request stays pinned for a reader
                    that pulls the classic way, which then succeeds byte-exact
    switched off    transceiver.read_ahead: false pulls such params the classic way (Blocks on the wire)
"""

from __future__ import annotations

import threading

import pytest
import zmq

from kvbridge.formatter.layout import KVLayout, KVShape, ParallelSplit
from kvbridge.transceiver import DisaggParams
from kvbridge.transceiver import messages as m

from .ranks import Cluster, RankProc

SHAPE = KVShape(num_layers=4, num_kv_heads=2, head_dim=16, dtype="float16", tokens_per_block=16)
CTX, GEN = KVLayout(SHAPE), KVLayout(SHAPE, ParallelSplit(tp=2))  # both generation ranks read context rank 0
FAST = {"agents": ["nixl"], "lease_s": 2.0, "heartbeat_s": 0.25, "peer_timeout_s": 3.0, "pickup_timeout_s": 5.0,
        "handshake_timeout_s": 1.0, "transfer_timeout_s": 20.0, "drain_timeout_s": 1.0}
pytestmark = pytest.mark.alone  # FAST: handshakes of 1 s, leases of 2 s (tests/conftest.py)
NB = 16


class _Relay:
    """A ZeroMQ relay between the generation ranks and one context rank; `seen` lists (direction, type,
    read_ahead) of every frame it passed, in order ("g>c" or "c>g")."""

    def __init__(self, endpoint: str) -> None:
        self.zctx = zmq.Context()
        self.front = self.zctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 0)
        self.front.bind("tcp://127.0.0.1:0")
        self.endpoint = self.front.getsockopt_string(zmq.LAST_ENDPOINT)
        self.target, self.backs, self.seen = endpoint, {}, []
        self.dones: list[tuple[int, int, str, bool]] = []  # (request, gen rank, "fetch" | "done", carries Done)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            poller = zmq.Poller()
            for s in (self.front, *self.backs.values()):
                poller.register(s, zmq.POLLIN)
            for s, _ in poller.poll(50):
                if s is self.front:  # one message may carry several frames (a loop turn's batch)
                    ident, *frames = s.recv_multipart()
                    if ident not in self.backs:
                        self.backs[ident] = self.zctx.socket(zmq.DEALER)
                        self.backs[ident].setsockopt(zmq.LINGER, 0)
                        self.backs[ident].connect(self.target)
                    self._note("g>c", frames)
                    self.backs[ident].send_multipart(frames)
                else:
                    frames = s.recv_multipart()
                    self._note("c>g", frames)
                    self.front.send_multipart([next(i for i, b in self.backs.items() if b is s), *frames])

    def _note(self, way: str, frames: list[bytes]) -> None:
        for frame in frames:
            msg = m.decode(frame)
            self.seen.append((way, msg.TYPE, getattr(msg, "read_ahead", None)))
            if isinstance(msg, (m.Fetch, m.Done)):
                self.dones.append((msg.ctx_request_id, msg.gen_rank, msg.TYPE, getattr(msg, "done", True)))

    def types(self, way: str) -> list[str]:
        return sorted({t for w, t, _ in self.seen if w == way and t not in ("heartbeat", "heartbeat_ack")})

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        for s in (self.front, *self.backs.values()):
            s.close(0)
        self.zctx.term()


def _setup(config=None):
    c = Cluster(0)
    c.procs = [RankProc() for _ in range(3)]
    c.setup(CTX, GEN, NB, NB, config or FAST)
    return c, _Relay(c.endpoints[0])


def _params(c, relay, rid, secret_hex, blocks) -> dict:
    return DisaggParams(rid, c.instance, (relay.endpoint,), CTX, bytes.fromhex(secret_hex), blocks).to_dict()


def _finished(c, rid):
    return [(s, d) for r, s, d in c.ctx_status()[0]["finished"] if r == rid]


@pytest.mark.parametrize("read_ahead", [True, False], ids=["on", "switched_off"])
def test_a_vouched_read_ahead_pull_is_byte_exact_and_the_context_rank_sends_no_blocks(read_ahead):
    c, relay = _setup({**FAST, "read_ahead": read_ahead})
    try:
        for rid, ctx_blocks, gen_blocks in ((1, [3, 7], [2, 5]), (2, [0, 1], [9, 4])):
            (secret,) = c.ctx[0].call("publish_minted", [(rid, ctx_blocks, 20, rid)])
            answers = c.pull([[rid, _params(c, relay, rid, secret, ctx_blocks), gen_blocks, 20, rid]])
            for ans in answers:
                assert ans["results"][0]["ok"], ans["results"]
                assert ans["mismatched_bytes"] == 0
            assert c.wait_ctx_released()[0]["pinned"] == 0
            assert _finished(c, rid) == [("complete", "all readers confirmed")]
        fetches = [ra for way, t, ra in relay.seen if t == "fetch"]
        assert fetches == [read_ahead] * 4  # 2 requests x 2 generation ranks
        want = ["done_ack", "welcome"] if read_ahead else ["blocks", "done_ack", "welcome"]
        assert relay.types("c>g") == want
    finally:
        relay.close()
        c.close()


REFUSALS = {  # how the request or its params make the read-ahead impossible to vouch for -> the reason named
    "caller_secret": ("publish", None, "under a secret chosen by the caller"),
    "streamed_publish": ("publish_minted_streaming", None, "published before all its layers were final"),
    "other_block_ids": ("publish_minted", [3, 8], "the 2 block ids in its DisaggParams are not the 2 it was"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_read_ahead_the_context_rank_cannot_vouch_for_fails_the_pull_and_a_classic_pull_then_succeeds(case):
    publish, wrong_blocks, reason = REFUSALS[case]
    c, relay = _setup()
    try:
        rid, ctx_blocks, gen_blocks = 4, [3, 7], [2, 5]
        got = c.ctx[0].call(publish, [(rid, ctx_blocks, 20, rid)])
        secret = got[0] if isinstance(got, list) else c.key.secret(rid).hex()
        if publish.endswith("streaming"):
            c.ctx[0].call("layers_ready", (rid, SHAPE.num_layers))
        ahead = _params(c, relay, rid, secret, wrong_blocks or ctx_blocks)
        for ans in c.pull([[rid, ahead, gen_blocks, 20, rid]]):
            r = ans["results"][0]
            assert not r["ok"] and r["error_type"] == "ReadAheadRefused", r
            assert f"refuses the read-ahead of request {rid}: " in r["error"] and reason in r["error"], r
            assert ans["mismatched_bytes"] == 0  # nothing written outside the failed pull's blocks
        status = c.ctx_status()[0]
        assert status["pinned"] == 1 and _finished(c, rid) == []  # still pinned, for a reader that can read it
        classic = {k: v for k, v in ahead.items() if k != "ctx_block_ids"}
        for ans in c.pull([[rid + 1, classic, gen_blocks, 20, rid]]):
            assert ans["results"][0]["ok"], ans["results"]
            assert ans["mismatched_bytes"] == 0
        assert c.wait_ctx_released()[0]["pinned"] == 0
        assert _finished(c, rid) == [("complete", "all readers confirmed")]
    finally:
        relay.close()
        c.close()


@pytest.mark.parametrize("bad", [[-1], [True], ["3"], "3,4", [1 << 63], {"a": 1}])
def test_disagg_params_refuse_ctx_block_ids_that_are_not_a_list_of_block_ids(bad):
    from kvbridge.errors import ProtocolError

    good = DisaggParams(1, "i", ("tcp://127.0.0.1:1",), CTX, b"s" * 16, [4, 2]).to_dict()
    assert DisaggParams.from_dict(good).ctx_block_ids == (4, 2) and good["ctx_block_ids"] == [4, 2]
    with pytest.raises(ProtocolError, match="ctx_block_ids must be a list of at most"):
        DisaggParams.from_dict({**good, "ctx_block_ids": bad})


def test_a_read_ahead_fetch_round_trips_with_its_block_ids():
    import numpy as np

    f = m.decode(m.Fetch(7, 1, False, False, 0, b"s" * 16, True, np.array([9, 1 << 40])).encode())
    assert f.read_ahead and f.block_ids.tolist() == [9, 1 << 40]
    plain = m.decode(m.Fetch(7, 1).encode())
    assert not plain.read_ahead and plain.block_ids.size == 0
