"""Keep-alive: the router drops idle connections before a worker's uvicorn would close them, and a context
request on a connection the worker closed without answering is sent again once, on a fresh connection,
without taking the worker out. Fault injector: a context worker that hangs up on its first request."""

from __future__ import annotations

import http.server
import json
import threading
import time

import pytest
import uvicorn
from fastapi.testclient import TestClient

from kvbridge.serving.config import parse_config
from kvbridge.serving.router import KEEPALIVE_EXPIRY_S, Router


def test_idle_connections_are_dropped_before_uvicorn_closes_them():
    assert KEEPALIVE_EXPIRY_S < uvicorn.Config(app=None).timeout_keep_alive


class _Fake(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    posts: list[str] = []

    def do_GET(self):  # /health
        self._send(200, {"status": "ok", "capacity_tokens": 4096})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        _Fake.posts.append(self.path)
        if body.get("disaggregated_params", {}).get("request_type") == "context_only":
            if _Fake.posts.count(self.path) == 1:
                self.close_connection = True  # hang up without an answer, as a closing keep-alive would
                return
            self._send(200, {"disaggregated_params": {"request_type": "generation_only"}, "kvbridge": {}})
        else:
            self._send(200, {"choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                             "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    def _send(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


@pytest.fixture
def fakes():
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Fake) for _ in range(2)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    _Fake.posts = []
    yield [f"127.0.0.1:{s.server_port}" for s in servers]
    for s in servers:
        s.shutdown()
        s.server_close()


def test_a_context_hop_on_a_connection_closed_under_it_is_sent_again_once_fresh(fakes):
    cfg = parse_config({"model": "seeded:tiny3", "router": {"health_interval_s": 60},
                        "context_servers": {"urls": [fakes[0]]}, "generation_servers": {"urls": [fakes[1]]}})
    with TestClient(Router(cfg).app) as client:
        deadline = time.monotonic() + 30
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, client.get("/health").json()
            time.sleep(0.05)
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == "ok"
        assert _Fake.posts == ["/v1/completions"] * 3  # context twice (the second fresh), generation once
        assert client.get("/health").json()["context_workers"] == {"ctx0": True}
