"""netaddr.free_port: ports for programs that must be given a number, outside the kernel's ephemeral range."""

from __future__ import annotations

import os
import socket

import pytest

from kvbridge import netaddr
from kvbridge.netaddr import free_port, is_loopback, loopback_interfaces


def _ephemeral() -> tuple[int, int]:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        lo, hi = (int(x) for x in f.read().split())
    return lo, hi


def test_picked_ports_are_outside_the_ephemeral_range_and_bindable():
    lo, hi = _ephemeral()
    for _ in range(50):
        p = free_port()
        assert not lo <= p <= hi, (p, lo, hi)
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_span_is_consecutive_free_ports():
    for _ in range(20):
        p = free_port(span=3)
        with socket.socket() as a, socket.socket() as b, socket.socket() as c:
            for s, q in ((a, p), (b, p + 1), (c, p + 2)):
                s.bind(("127.0.0.1", q))


def test_a_port_held_by_a_listener_is_never_picked(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        picks = iter([taken - 1, taken, *range(taken - 3, taken - 40, -2)])  # the first two spans hold `taken`
        monkeypatch.setattr(netaddr, "_ephemeral_range", lambda: (taken + 10, taken + 20))
        monkeypatch.setattr(netaddr, "random", type("R", (), {"choice": staticmethod(lambda r: r[0]),
                                                               "randrange": staticmethod(lambda a, b: next(picks))}))
        p = free_port(span=2)
        assert p <= taken - 3, (p, taken)


def test_with_no_room_outside_the_range_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(netaddr, "_ephemeral_range", lambda: (1024, 65535))
    p = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", p))


def test_a_bad_span_is_named():
    with pytest.raises(ValueError, match="span must be >= 1"):
        free_port(span=0)


def test_loopback():
    assert is_loopback("127.0.0.2") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("10.0.0.1") and not is_loopback("not an address")


def test_loopback_interfaces_name_lo_where_nothing_is_named():
    env = {"NCCL_SOCKET_IFNAME": "eth1"}
    loopback_interfaces(env, ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"))
    want = "lo" if os.path.isdir("/sys/class/net/lo") else None
    assert env == {"NCCL_SOCKET_IFNAME": "eth1", **({"GLOO_SOCKET_IFNAME": want} if want else {})}
