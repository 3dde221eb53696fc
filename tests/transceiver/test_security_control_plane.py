"""Closed by default: the Welcome (NIXL metadata, pool addresses) only ever reaches authenticated peers.

Real ZeroMQ sockets against a real context transceiver: the outsider is a raw DEALER that speaks the protocol
correctly, so the only thing that can stop it is the control plane's own door.
"""

from __future__ import annotations

import logging
import socket
import time

import numpy as np
import pytest
import zmq
from prometheus_client import REGISTRY

from kvbridge.cli import main as cli
from kvbridge.formatter.layout import KVLayout, KVShape
from kvbridge.formatter.verify import pool_image
from kvbridge.transceiver import CacheTransceiver, TransceiverConfig
from kvbridge.transceiver import messages as m
from kvbridge.transceiver.config import ConfigError
from kvbridge.transceiver.zap import RejectLog

LAY = KVLayout(KVShape(2, 2, 8, "float32", 16))


def _non_loopback_ip() -> str | None:
    """This host's address on its network (where an outsider would connect), if it has one."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.254", 9))  # no packet is sent: this only picks the outgoing interface
        ip = s.getsockname()[0]
    except OSError:
        return None
    finally:
        s.close()
    return None if ip.startswith("127.") else ip


def _outsider_hello(endpoint: str, wait_s: float = 1.5, **curve) -> list[bytes]:
    """A DEALER that connects and says Hello; every frame it got back within wait_s."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    for k, v in curve.items():
        setattr(s, k, v)
    s.connect(endpoint)
    s.send(m.Hello("mallory", 0, LAY.to_wire(), ["nixl", "tcp", "cuda_ipc"]).encode())
    got = []
    while s.poll(wait_s * 1000):
        got.append(s.recv())
    s.close()
    return got


def _ctx(cfg: TransceiverConfig):
    return CacheTransceiver.context(pool_image(LAY, 0, 8, [([1, 2], 20, 5)]).copy(), LAY, 0, 8, cfg)


def test_by_default_a_context_rank_listens_on_loopback_only_and_an_outsider_gets_no_welcome():
    ip = _non_loopback_ip()
    if ip is None:
        pytest.skip("this host has no non-loopback IPv4 address to play the outsider from")
    with _ctx(TransceiverConfig(agents=("nixl",))) as ctx:
        assert ctx.endpoint.startswith("tcp://127.0.0.1:")
        port = ctx.endpoint.rsplit(":", 1)[1]
        assert _outsider_hello(f"tcp://{ip}:{port}") == []  # nothing at all: no Welcome, no metadata
        (w,) = _outsider_hello(ctx.endpoint)  # (the door is loopback: a local process of the deployment)
        assert isinstance(m.decode(w), m.Welcome)


def test_a_non_loopback_bind_without_keys_is_refused_unless_insecure_says_so(caplog):
    cfg = TransceiverConfig(agents=("nixl",), bind_host="0.0.0.0", advertise_host="127.0.0.1")
    with pytest.raises(ConfigError, match=r"transceiver.bind_host '0.0.0.0' is not a loopback address.*"
                                          r"curve_secret_key_file.*insecure: true"):
        _ctx(cfg)
    with caplog.at_level(logging.WARNING, logger="kvbridge.transceiver.sockets"):
        with _ctx(cfg.with_(insecure=True)) as ctx:
            (w,) = _outsider_hello(ctx.endpoint)
            assert isinstance(m.decode(w), m.Welcome)
    assert any("insecure: true" in r.message and r.levelno == logging.WARNING for r in caplog.records)
    with pytest.raises(ConfigError, match="transceiver.insecure must be true or false"):
        TransceiverConfig.from_dict({"insecure": "yes"})


def _rejected(reason: str) -> float:
    return REGISTRY.get_sample_value("kvbridge_transceiver_rejected_peers_total", {"reason": reason}) or 0.0


def test_with_keys_an_unauthorised_key_gets_nothing_and_is_logged_and_counted(tmp_path, caplog):
    import zmq.auth

    for name, where in (("server", "server"), ("gen", "allowed"), ("intruder", "other")):
        assert cli(["keys", str(tmp_path / where), "--name", name]) == 0
    server_pub, _ = zmq.auth.load_certificate(str(tmp_path / "server/server.key"))
    cfg = TransceiverConfig(agents=("nixl",), bind_host="0.0.0.0", advertise_host="127.0.0.1",
                            curve_secret_key_file=str(tmp_path / "server/server.key_secret"),
                            curve_authorized_keys_dir=str(tmp_path / "allowed"))
    before, before_plain = _rejected("key"), _rejected("mechanism")
    with caplog.at_level(logging.WARNING, logger="kvbridge.auth"), _ctx(cfg) as ctx:
        def as_(who):
            pub, sec = zmq.auth.load_certificate(str(tmp_path / who))
            return {"curve_publickey": pub, "curve_secretkey": sec, "curve_serverkey": server_pub}

        for _ in range(3):  # three tries: three counted, one line (rate-limited per address)
            assert _outsider_hello(ctx.endpoint, 1.0, **as_("other/intruder.key_secret")) == []
        assert _outsider_hello(ctx.endpoint, 1.0) == []  # no CURVE at all: dropped in the handshake
        (w,) = _outsider_hello(ctx.endpoint, **as_("allowed/gen.key_secret"))
        assert isinstance(m.decode(w), m.Welcome)
    lines = [r.message for r in caplog.records if "refused a peer" in r.message]
    print(lines)
    keyed = [x for x in lines if "CURVE key" in x]
    assert len(keyed) == 1 and "not in curve_authorized_keys_dir" in keyed[0]
    # the plain peer never reaches ZAP: the socket monitor logs and counts it (issue 13: rejections logged)
    plain = [x for x in lines if "failed the CurveZMQ handshake" in x]
    assert len(plain) == 1 and len(lines) == 2, lines
    assert _rejected("key") - before == 3 and _rejected("mechanism") - before_plain >= 1  # it reconnects


def test_refusals_are_logged_once_per_address_per_window_with_a_count(caplog):
    rl = RejectLog("ctx rank 0", every_s=10)
    with caplog.at_level(logging.WARNING, logger="kvbridge.auth"):
        for t in range(25):
            rl.refused("10.0.0.9", "key", "unknown key", now=100.0 + t)
        rl.refused("10.0.0.8", "key", "unknown key", now=130.0)
    lines = [r.message for r in caplog.records]
    assert len(lines) == 4 and rl.total == 26
    assert "9 more refused from it in the last 10 s" in lines[1] and "10.0.0.8" in lines[3]


def test_extra_hellos_beyond_max_sessions_get_a_clear_error():
    with _ctx(TransceiverConfig(agents=("nixl",), max_sessions=2)) as ctx:
        before = _rejected("sessions")
        socks = []
        for i in range(3):
            s = zmq.Context.instance().socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(ctx.endpoint)
            s.send(m.Hello(f"gen{i}", 0, LAY.to_wire(), ["nixl"]).encode())
            assert s.poll(5000)
            socks.append((s, m.decode(s.recv())))
        assert [type(a) for _, a in socks] == [m.Welcome, m.Welcome, m.Error]
        err = socks[2][1]
        assert err.code == m.ErrorCode.BUSY.value and "transceiver.max_sessions" in err.message
        assert ctx.sender.sessions == 2 and _rejected("sessions") - before == 1
        for s, _ in socks:
            s.close()


@pytest.mark.alone  # a peer timeout of 0.6 s (tests/conftest.py)
def test_pulls_still_work_after_idle_sessions_outlive_the_peer_timeout():
    """A generation rank idle for longer than peer_timeout_s keeps its session (empty heartbeats)."""
    cfg = TransceiverConfig(agents=("nixl",), peer_timeout_s=0.6, heartbeat_s=0.1, lease_s=2.0)
    with _ctx(cfg) as ctx, CacheTransceiver.generation(pool_image(LAY, 0, 8, [], 9).copy(), LAY, 0, 8, cfg) as gen:
        from kvbridge.transceiver import DisaggParams

        class R:
            def __init__(self, **kw):
                self.__dict__.update(kw)

        for rid in (1, 2):
            sec = ctx.respond_and_send_async(R(request_id=rid, block_ids=np.array([1, 2]), num_tokens=20))
            gen.request_and_receive_async(R(request_id=rid, block_ids=np.array([3, 4]), num_tokens=20,
                                            disagg_params=DisaggParams(rid, ctx.instance, (ctx.endpoint,), LAY, sec)))
            (r,) = gen.check_gen_transfer_status(1, timeout_s=20)
            assert r.ok, r.error
            assert ctx.check_context_transfer_status(1, timeout_s=5)[0].status == "complete"
            if rid == 1:  # idle for 3 peer timeouts: the session stays all along (watched, not slept on)
                end = time.monotonic() + 3 * cfg.peer_timeout_s
                while time.monotonic() < end:
                    assert ctx.sender.sessions == 1
                    time.sleep(0.02)
