"""Issue 27: the router's health probing tolerates a slow /health (a loaded host) and takes a worker out
only after `router.health_failures` consecutive misses, each bounded by `router.health_timeout_s`; a
refused connection takes it out at once. Probes go to a real HTTP server whose delay the test sets."""

from __future__ import annotations

import asyncio
import http.server
import threading

import httpx
import pytest

from kvbridge.errors import ServeConfigError
from kvbridge.serving.balancer import WorkerRef
from kvbridge.serving.config import _router
from kvbridge.serving.health import HealthRule, probe


class SlowHealth(http.server.BaseHTTPRequestHandler):
    gate = threading.Event()  # cleared: /health waits (bounded) before answering

    answer = (200, b'{"status": "ok", "capacity_tokens": 4096}')

    def do_GET(self):  # noqa: N802
        self.gate.wait(10)
        code, body = self.answer
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture()
def server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), SlowHealth)
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    SlowHealth.gate.set()
    yield srv
    SlowHealth.gate.set()
    SlowHealth.answer = (200, b'{"status": "ok", "capacity_tokens": 4096}')
    srv.shutdown()
    srv.server_close()


def test_slow_probes_remove_only_after_consecutive_misses_refused_at_once(server):
    w = WorkerRef("gen0", f"http://127.0.0.1:{server.server_address[1]}", "generation")
    rule = HealthRule(failures=3)

    async def run():
        async with httpx.AsyncClient() as client:
            async def check():
                await probe(client, w, httpx.Timeout(0.3), rule)

            await check()
            assert w.healthy and w.capacity_tokens == 4096
            SlowHealth.gate.clear()  # the host is loaded: /health answers late
            for miss in (1, 2):
                await check()
                assert w.healthy, f"taken out after {miss} slow probe(s)"
                assert f"miss {miss} of 3" in w.last_error
            await check()
            assert not w.healthy and "ReadTimeout" in w.last_error
            SlowHealth.gate.set()
            await check()
            assert w.healthy
            server.shutdown()
            server.server_close()  # nothing listens now: refused
            await check()
            assert not w.healthy and "ConnectError" in w.last_error

    asyncio.run(run())


def test_a_worker_out_for_its_own_503_is_out_with_the_reason_it_gave(server):
    w = WorkerRef("ctx1", f"http://127.0.0.1:{server.server_address[1]}", "context")
    SlowHealth.answer = (503, b'{"status": "stalled", "error": "its executor\'s ranks answered no probe for 5s"}')

    async def run():
        async with httpx.AsyncClient() as client:
            for _ in range(3):
                await probe(client, w, httpx.Timeout(5), HealthRule(failures=1))
            assert not w.healthy

    asyncio.run(run())
    assert w.last_error == "/health answered 503: stalled: its executor's ranks answered no probe for 5s"


def test_router_health_settings_are_validated():
    r = _router({"health_timeout_s": 7.5, "health_failures": 5})
    assert (r.health_timeout_s, r.health_failures) == (7.5, 5)
    assert (_router({}).health_timeout_s, _router({}).health_failures) == (5.0, 3)
    with pytest.raises(ServeConfigError, match="router.health_failures"):
        _router({"health_failures": 0})
    with pytest.raises(ServeConfigError, match="router.health_timeout_s"):
        _router({"health_timeout_s": 0})
