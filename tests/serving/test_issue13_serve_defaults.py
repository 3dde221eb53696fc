"""Issue 13, checked on the whole system: `kvbridge serve` with its defaults (no keys, no `insecure` in the
config) runs an authenticated control plane. An outsider on the same host that speaks the protocol correctly
(a raw ZeroMQ DEALER sending a Hello to the context rank's real endpoint) gets no Welcome and no metadata, is
logged and counted, and pins nothing; the deployment's own generation worker still pulls, byte-exact.
Real processes: serve, its workers, their ranks and router; real ZeroMQ and HTTP."""

from __future__ import annotations


import httpx
import pytest
import zmq

from kvbridge.formatter.layout import KVLayout, KVShape
from kvbridge.transceiver import messages as m

from .cluster import HEADERS, MODEL, PATIENT, PROMPTS, Serve, wait_log, wait_pool_full
from .conftest import MAX_TOKENS

BLOCKS = 64
CFG = {
    "model": MODEL,
    "executor": {"num_blocks": BLOCKS, "tokens_per_block": 8, "threads_per_rank": 1, "timeout_s": 120},
    "transceiver": {"agent": "tcp", **PATIENT},
    "router": {"port": 0, "request_timeout_s": 120},
    "context_servers": {"instances": 1},
    "generation_servers": {"instances": 1},
}


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    s = Serve(tmp, CFG)
    try:
        yield {"proc": s.proc, "log": s.log, "router": s.router, **s.urls}
    finally:
        s.stop()


def _outsider_hello(endpoint: str, wait_s: float = 3.0) -> list[bytes]:
    """A plain (unauthenticated) DEALER that connects and says Hello; every frame it got back within wait_s."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    s.send(m.Hello("mallory", 0, KVLayout(KVShape(2, 2, 8, "float32", 16)).to_wire(), ["nixl", "tcp", "cuda_ipc"]).encode())
    got = []
    while s.poll(wait_s * 1000):
        got.append(s.recv())
    s.close()
    return got


def _rejected(url: str) -> float:
    text = httpx.get(url + "/metrics", headers=HEADERS, timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvbridge_transceiver_rejected_peers_total{"))


def test_serve_defaults_give_an_unauthenticated_zeromq_peer_no_welcome_and_still_pull_exactly(serve, want):
    ctx, gen = serve["ctx0"], serve["gen0"]
    body = {"prompt": PROMPTS[2], "max_tokens": MAX_TOKENS, "temperature": 0}
    r = httpx.post(ctx + "/v1/completions", headers=HEADERS, timeout=120,
                   json={**body, "disaggregated_params": {"request_type": "context_only"}})
    assert r.status_code == 200, r.text
    params = r.json()["disaggregated_params"]
    (endpoint,) = params["ctx_params"]["endpoints"]
    assert endpoint.startswith("tcp://127.0.0.1:")  # closed by default: loopback only, yet curve on top
    mark = len(serve["log"].read_text(errors="replace"))
    for _ in range(3):
        assert _outsider_hello(endpoint) == [], "an unauthenticated peer got an answer (Welcome/metadata)"
    wait_log(serve["log"], r"refused a peer at", serve["proc"], timeout=60, after=mark)
    assert _rejected(ctx) >= 1
    # the outsider pinned nothing extra, and the deployment's own generation worker pulls byte-exact
    r = httpx.post(gen + "/v1/completions", headers=HEADERS, timeout=120,
                   json={**body, "disaggregated_params": params})
    assert r.status_code == 200, r.text
    assert r.json()["kvbridge"]["token_ids"] == want["prompts"][2]
    assert wait_pool_full(ctx, BLOCKS, 1) == [BLOCKS] and wait_pool_full(gen, BLOCKS, 1) == [BLOCKS]
    assert serve["proc"].poll() is None
