"""What TCP sockets a process (and its children) listen on, read from /proc: for tests that check nothing is
reachable from the network that should not be."""

from __future__ import annotations

import ipaddress
import os


Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def listening(with_children: bool = False, groups: frozenset[int] = frozenset()) -> set[tuple[Address, int]]:
    """(address, port) of every TCP socket in LISTEN state that this process, with `with_children` its direct
    children, and every process of the process `groups` hold (IPv4-mapped IPv6 addresses as IPv4)."""
    me, inodes = str(os.getpid()), set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if pid != me:
                if not with_children and not groups:
                    continue
                with open(f"/proc/{pid}/stat") as f:
                    parent, group = f.read().rsplit(")", 1)[1].split()[1:3]
                if not (with_children and parent == me) and int(group) not in groups:
                    continue
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for cols in (line.split() for line in f.readlines()[1:]):
                if cols[3] != "0A" or cols[9] not in inodes:
                    continue
                host, port = cols[1].rsplit(":", 1)
                raw = bytes.fromhex(host)  # each 32-bit word of the address in host (little-endian) order
                ip = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
                out.add(((ip.ipv4_mapped or ip) if ip.version == 6 else ip, int(port, 16)))
    return out
