"""Address helpers every layer may use (like errors.py and codec.py, below all packages; imports nothing of
kvbridge, so importing it never starts metrics, sockets or torch)."""

from __future__ import annotations

import ipaddress
import os
import random
import socket

__all__ = ["is_loopback", "free_port", "loopback_interfaces"]

# Ports picked for programs that must be given a number come from below the kernel's ephemeral range
# (net.ipv4.ip_local_port_range, where outgoing connections and port-0 binds get theirs) and above this.
_PICK_FROM = 20000
_TRIES = 200


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost: addresses no other host can reach."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def loopback_interfaces(env, names) -> None:
    """Set each of the environment variables `names` (a library's interface choice: GLOO_SOCKET_IFNAME,
    NCCL_SOCKET_IFNAME, UCX_NET_DEVICES) in `env` to the loopback interface, unless `env` already names one;
    for processes whose peers are all on this host. Nothing where no interface is named `lo`."""
    if os.path.isdir("/sys/class/net/lo"):
        for name in names:
            env.setdefault(name, "lo")


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))  # no SO_REUSEADDR: a listener, a connection or a TIME_WAIT on it refuses
            return True
        except OSError:
            return False


def free_port(host: str = "127.0.0.1", span: int = 1) -> int:
    """The first of `span` consecutive TCP ports nothing on `host` holds now, for a program that must be given
    a number and binds it a moment later (vLLM's API server; NixlConnector's side channel, rank r on port + r).

    Picked at random below the kernel's ephemeral range, so no outgoing connection or port-0 bind on this host
    can take it in between (the kernel's own pick, port 0, was the ephemeral range: a ZeroMQ or HTTP client
    of another process could get it before the server bound it). Each port is probed by binding it. Where the
    host's ephemeral range leaves no room below it, ports above it are used; failing that, the kernel's pick."""
    if span < 1:
        raise ValueError(f"free_port: span must be >= 1, got {span}")
    lo, hi = _ephemeral_range()
    ranges = [(a, b) for a, b in ((_PICK_FROM, lo - span), (hi + 1, 65536 - span)) if b > a]
    for _ in range(_TRIES if ranges else 0):
        a, b = random.choice(ranges)
        first = random.randrange(a, b)
        if all(_bindable(host, first + i) for i in range(span)):
            return first
    for _ in range(_TRIES):  # nothing outside the ephemeral range: the kernel's pick (and its neighbours)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            first = s.getsockname()[1]
        if first + span <= 65536 and all(_bindable(host, first + i) for i in range(1, span)):
            return first
    raise OSError(f"free_port: no {span} consecutive free TCP port(s) on {host}")
