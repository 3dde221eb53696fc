"""KV events over CurveZMQ, on a real executor (rank processes, real ZeroMQ with ZAP, a real prefix cache):
with the worker's control-plane key pair (a transceiver `curve_secret_key_file`) the PUB and the replay
ROUTER are CURVE servers that let in only the client key derived from the deployment's token. The router's
subscriber follows such a worker (its index equals the worker's own dump); a subscriber with a wrong client
key, without the server key, or with the old PLAIN password receives no event and no replay answer; a router
whose deployment runs Curve does not follow a worker that advertises no Curve key."""

from __future__ import annotations

import json
import os
import random
import time

import pytest
import zmq
import zmq.auth
from kvbridge import codec
from kvbridge.executor.kv_curve import subscriber_keys
from kvbridge.executor.kv_events import derive_secret, subscriber_password
from kvbridge.executor.runtime import Executor, ExecutorConfig
from kvbridge.serving.kv_index import KvIndex
from kvbridge.serving.kv_subscriber import KvEventsClient
from zmq.utils.monitor import recv_monitor_message

MODEL = "seeded:tiny3"
SECRET = derive_secret("the-deployment-token")
TPB, BLOCKS = 4, 24


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """One executor publishing its KV events over CurveZMQ with a transceiver-style key file."""
    d = tmp_path_factory.mktemp("kv-curve")
    _public, secret_file = zmq.auth.create_certificates(str(d), "context")
    ef = os.path.join(str(d), "kv-events.json")
    ex = Executor.start(ExecutorConfig(model=MODEL, num_blocks=BLOCKS, tokens_per_block=TPB, timeout_s=120,
                                       enable_block_reuse=True,
                                       kv_events={"secret": SECRET.hex(), "incarnation": "c0-a", "host": "127.0.0.1",
                                                  "endpoint_file": ef, "curve_secret_key_file": secret_file}))
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(ef):
            assert time.monotonic() < deadline, "the leader never wrote its KV event endpoints"
            time.sleep(0.05)
        with open(ef) as f:
            info = {**json.load(f), "incarnation": "c0-a"}
        yield ex, info
    finally:
        ex.close()


def _wait(pred, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


_SEEDS = iter(range(1, 1000))


def _run(ex: Executor) -> None:
    """New prompts (a fresh seed each call: cached prompts would store no block, so publish no event)."""
    rng = random.Random(next(_SEEDS))
    shared = [rng.randrange(1, 200) for _ in range(8)]
    ex.generate([shared + [rng.randrange(1, 200) for _ in range(rng.randrange(2, 12))] for _ in range(4)],
                max_tokens=2, timeout=120)


def _forged(ctx: zmq.Context, kind: int, how: str, info: dict) -> zmq.Socket:
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    if how == "wrong_client_key":  # the worker's public key, but a client key not derived from the token
        s.curve_serverkey = info["curve_server_key"].encode()
        s.curve_publickey, s.curve_secretkey = zmq.curve_keypair()
    elif how == "wrong_server_key":  # the token's client key, but not the worker's server key
        s.curve_serverkey = zmq.curve_keypair()[0]
        s.curve_publickey, s.curve_secretkey = subscriber_keys(SECRET)
    else:  # "plain": the token-derived PLAIN password of a deployment without Curve
        s.plain_username, s.plain_password = b"kvbridge", subscriber_password(SECRET)
    return s


def test_the_router_follows_a_worker_over_curve_and_its_index_equals_the_dump(worker):
    ex, info = worker
    assert len(info["curve_server_key"]) == 40
    client = KvEventsClient(KvIndex(), SECRET, replay_timeout_s=10, require_curve=True)
    try:
        client.sync_worker("c0", info)
        _wait(lambda: client.synced("c0"), "the dump over CurveZMQ")
        before = client.stats["batches"]
        _run(ex)
        _wait(lambda: client.stats["batches"] > before, "events over CurveZMQ")
        assert client.barrier(30)
        got = client._ask(client._conns["c0"], {"op": "dump"})
        assert got is not None and client.last_seq("c0") == got["seq"]
        assert client.index.blocks_of("c0") == {bytes(b[0]): b[1] for b in got["blocks"]}
        assert client.stats["rejected"] == 0
    finally:
        client.close()


@pytest.mark.parametrize("how", ["wrong_client_key", "wrong_server_key", "plain"])
def test_a_forged_subscriber_receives_no_event_and_the_replay_refuses_it(worker, how):
    ex, info = worker
    client = KvEventsClient(KvIndex(), SECRET, replay_timeout_s=10, require_curve=True)  # the real one
    ctx = zmq.Context()
    sub, dealer = _forged(ctx, zmq.SUB, how, info), _forged(ctx, zmq.DEALER, how, info)
    mon = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(info["pub"])
        dealer.connect(info["replay"])
        client.sync_worker("c0", info)
        _wait(lambda: client.synced("c0"), "the real subscriber's dump")
        before = client.stats["batches"]
        _run(ex)  # events flow: the real subscriber gets them ...
        _wait(lambda: client.stats["batches"] > before, "events for the real subscriber")
        try:  # a refused handshake may leave the forger no pipe at all: its send then cannot even queue
            dealer.send_multipart([b"", codec.pack({"v": 1, "op": "dump"})], flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
        assert not sub.poll(2000), f"{how}: a forged subscriber received an event"  # ... the forger none
        assert not dealer.poll(1000), f"{how}: the replay socket answered a forged subscriber"
        assert not mon.poll(0), f"{how}: the forged subscriber completed a handshake"
        if how == "wrong_client_key":  # refused by the worker's ZAP handler, not just ignored
            assert _refusal(ctx, info) == zmq.EVENT_HANDSHAKE_FAILED_AUTH
    finally:
        ctx.destroy(linger=0)  # every socket, the monitor's too: a failed assertion must not hang ctx.term()
        client.close()


def _refusal(ctx: zmq.Context, info: dict) -> int:
    """The handshake outcome (a monitor event) of a fresh wrong-client-key subscriber."""
    s = _forged(ctx, zmq.SUB, "wrong_client_key", info)
    mon = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        s.connect(info["pub"])
        assert mon.poll(30000), "no handshake outcome within 30 s"
        return recv_monitor_message(mon)["event"]
    finally:
        s.disable_monitor()
        mon.close(0)
        s.close(0)


def test_a_curve_deployment_does_not_follow_a_worker_without_a_curve_key():
    client = KvEventsClient(KvIndex(), SECRET, replay_timeout_s=1, require_curve=True)
    try:
        client.sync_worker("p0", {"pub": "tcp://127.0.0.1:9", "replay": "tcp://127.0.0.1:9", "incarnation": "p"})
        assert client.barrier(10)
        assert "p0" not in client._conns and not client.synced("p0")
    finally:
        client.close()
