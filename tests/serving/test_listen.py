"""serving/listen.py: the sockets the workers, the router and the vLLM guard serve HTTP on."""

from __future__ import annotations

import asyncio
import socket

from kvbridge.serving.listen import bind


def test_connections_accepted_on_a_bound_socket_have_nagle_off():
    """asyncio (so uvicorn) turns Nagle off only on sockets whose proto says TCP; on the proto-0 socket `bind`
    made before, every HTTP answer written in two parts (headers, then body) waited for the client's delayed
    ACK, ~40 ms a hop (a 1-token completion through a loopback deployment: 101 ms p50, 17.7 ms after)."""
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    assert sock.proto == socket.IPPROTO_TCP
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    seen = []

    async def main():
        async def handle(reader, writer):
            seen.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(handle, sock=sock)  # as uvicorn serves a socket it is given
        async with server:
            _, w = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(100):
                if seen:
                    break
                await asyncio.sleep(0.02)
            w.close()

    asyncio.run(main())
    assert seen and seen[0], "an accepted connection still has Nagle on"
