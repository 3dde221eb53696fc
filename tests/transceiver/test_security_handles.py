"""Unguessable request handles: a Fetch must carry the request's secret; without it, it learns nothing.

Real rank processes and real ZeroMQ sockets; the attacker is a raw DEALER that completes the handshake (as any
peer allowed on the control plane can) and then guesses.
"""

from __future__ import annotations

import pytest
import zmq

from kvbridge.errors import ProtocolError
from kvbridge.formatter.layout import KVLayout, KVShape
from kvbridge.transceiver import DisaggParams
from kvbridge.transceiver import messages as m
from kvbridge.transceiver.handles import RequestKey

from .ranks import Cluster, raw_session

LAYOUT = KVLayout(KVShape(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", tokens_per_block=16))
CFG = {"agents": ["nixl"], "lease_s": 2.0, "heartbeat_s": 0.25, "pickup_timeout_s": 20.0,
       "handshake_timeout_s": 1.0, "transfer_timeout_s": 10.0}
pytestmark = pytest.mark.alone  # handshakes of 1 s, leases of 2 s (tests/conftest.py)


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(2)
    c.setup(LAYOUT, LAYOUT, 16, 16, CFG)
    yield c
    c.close()


def _peer(endpoint: str) -> zmq.Socket:
    return raw_session(endpoint, LAYOUT, "mallory")


def _answers(endpoint: str, fetches: dict[str, m.Fetch]) -> dict[str, tuple]:
    """Send every Fetch from its own peer at once; each answer with the request id blanked out."""
    socks = {name: _peer(endpoint) for name in fetches}
    for name, f in fetches.items():
        socks[name].send(f.encode())
    out = {}
    for name, s in socks.items():
        assert s.poll(10000), f"no answer to the {name} fetch"
        a = m.decode(s.recv())
        rid = str(fetches[name].ctx_request_id)
        out[name] = (type(a).__name__, getattr(a, "code", ""), getattr(a, "message", "").replace(rid, "N"),
                     getattr(a, "reply_to", ""), a.ctx_request_id == fetches[name].ctx_request_id)
        s.close()
    return out


def test_a_fetch_with_a_wrong_or_missing_secret_pins_nothing_and_reads_like_an_unknown_id(cluster):
    c = cluster
    rid, other = 7, 7_000_000_000_000_000_003
    c.publish([(rid, [0, 1], 20, rid)])
    got = _answers(c.endpoints[0], {"wrong": m.Fetch(rid, 0, secret=bytes(16)),
                                    "missing": m.Fetch(rid, 0),
                                    "nearly": m.Fetch(rid, 0, secret=c.key.secret(rid)[:-1] + b"\0"),
                                    "unknown": m.Fetch(other, 0, secret=c.key.secret(other))})
    print(got)
    assert got["wrong"] == got["missing"] == got["nearly"] == got["unknown"]
    assert got["unknown"][:2] == ("Error", m.ErrorCode.UNKNOWN_REQUEST.value)
    assert c.ctx_status()[0]["pinned"] == 1  # still pinned for its real reader, and nobody else's
    (ans,) = c.pull([[rid, c.params(rid), [2, 3], 20, rid]])  # not "taken": the guesses started nothing
    assert ans["results"][0]["ok"], ans["results"][0]
    assert ans["mismatched_bytes"] == 0
    st = c.wait_ctx_released()[0]
    assert st["pinned"] == 0 and (rid, "complete", "all readers confirmed") in st["finished"]
    # finished: its status is told to the secret's holder only, and never as a counter
    late = _answers(c.endpoints[0], {"holder": m.Fetch(rid, 0, secret=c.key.secret(rid)),
                                     "guess": m.Fetch(rid, 0, secret=bytes(16)),
                                     "unknown": m.Fetch(other, 0)})
    assert late["guess"] == late["unknown"] == got["unknown"]
    assert late["holder"][2] == "request N is already finished"


def test_request_keys_give_63_bit_handles_and_128_bit_secrets():
    key = RequestKey.new()
    handles = {key.handle(r) for r in range(1, 2001)}
    assert len(handles) == 2000 and all(0 < h < 1 << 63 for h in handles)
    assert max(handles).bit_length() >= 60  # spread over the whole range, not counting up
    assert len(key.secret(1)) == 16 and key.secret(1) != key.secret(2) != RequestKey.new().secret(2)
    assert key.hex not in repr(key) and RequestKey.from_hex(key.hex).secret(5) == key.secret(5)


def test_disagg_params_carry_the_secret_as_hex_and_never_print_it():
    key = RequestKey.new()
    p = DisaggParams(key.handle(3), "ctx", ("tcp://127.0.0.1:1",), LAYOUT, key.secret(3))
    d = p.to_dict()
    assert d["secret"] == key.secret(3).hex() and DisaggParams.from_dict(d).to_dict() == d
    assert key.secret(3).hex() not in repr(p) and key.secret(3).hex() not in repr(m.Fetch(1, 0, secret=key.secret(3)))
    for bad, needle in (({"secret": 5}, "secret must be a hex string"), ({"secret": "zz"}, "secret is not hex"),
                        ({"ctx_request_id": 1 << 63}, "ctx_request_id must be in")):
        with pytest.raises(ProtocolError, match=needle):
            DisaggParams.from_dict({**d, **bad})


def test_a_guess_waiting_for_its_request_to_be_published_is_still_refused_when_it_is(cluster):
    c = cluster
    rid = 9
    guess = _peer(c.endpoints[0])
    guess.send(m.Fetch(rid, 0, secret=bytes(16)).encode())
    c.publish([(rid, [4, 5], 20, rid)])  # published while the guess waits: it must not turn into Blocks
    assert guess.poll(10000)
    a = m.decode(guess.recv())
    assert isinstance(a, m.Error) and a.code == m.ErrorCode.UNKNOWN_REQUEST.value and "has no request 9" in a.message
    guess.close()
    (ans,) = c.pull([[rid, c.params(rid), [6, 7], 20, rid]])
    assert ans["results"][0]["ok"] and ans["mismatched_bytes"] == 0


def test_publish_wait_s_keeps_an_early_fetch_past_the_handshake_timeout():
    """An early decode's Fetch may come while its prefill is still queued: `publish_wait_s` (here 4 s, the
    handshake timeout 1 s) keeps it; the publish 2 s later answers it with Blocks."""
    import time

    from kvbridge.transceiver.config import ConfigError, TransceiverConfig

    assert TransceiverConfig(handshake_timeout_s=3.0).publish_wait == 3.0
    assert TransceiverConfig(publish_wait_s=7).publish_wait == 7.0
    with pytest.raises(ConfigError, match="publish_wait_s"):
        TransceiverConfig(publish_wait_s=0)
    c = Cluster(2)
    try:
        c.setup(LAYOUT, LAYOUT, 16, 16, {**CFG, "publish_wait_s": 4.0})
        rid = 31
        waiting = _peer(c.endpoints[0])
        waiting.send(m.Fetch(rid, 0, secret=c.key.secret(rid)).encode())
        time.sleep(2.0)  # past handshake_timeout_s: the fetch must still be waiting (an Error would be here)
        assert not waiting.poll(0)
        c.publish([(rid, [8, 9], 20, rid)])
        assert waiting.poll(10000)
        b = m.decode(waiting.recv())
        assert isinstance(b, m.Blocks) and b.ctx_request_id == rid and list(b.block_ids) == [8, 9]
        waiting.close()
    finally:
        c.close()
