"""KVBridgeConnector under forged, stale and orphaned kv_transfer_params, with real vLLM servers.

What decides which KV a decode instance reads is the request's handle and secret (made by the prefill
engine's RequestKey), never an id from the caller: a forged object reads nothing it does not name, a
stale one (its prefill engine restarted, or killed between the hops) fails with the cause named in the
decode server's log, a client that gives up mid-request leaves no block held, and after every case the decode
engine still serves and holds no KV block.
"""

from __future__ import annotations

import copy
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from .pd import Cell, Servers, completion, decode, describe_of, digests, early_params, prefill, prompt, skip_reason
from .pd import kv_usage, tokens, wait_log, wait_no_blocks_held

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.skipif(skip_reason() is not None, reason=f"vLLM not available: {skip_reason()}")]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    s = Servers(str(tmp_path_factory.mktemp("vllm-faults")))
    s.define("p1", Cell(tp=1, block=32, cpus="0"))
    s.define("d1", Cell(tp=1, block=32, cpus="1"))
    yield s
    s.close()


def _refused(D, r, why: str) -> None:
    assert r.status_code >= 400, f"a forged request was answered: {r.text[:200]}"
    assert wait_log(D, why), f"the decode server's log does not name {why!r}{D.tail()}"


def test_forged_params_read_nothing_they_do_not_name(servers):
    P, D = servers.use("p1", "d1")
    a, b = prompt(200, 1), prompt(200, 2)
    pa, pb = prefill(P.url, a), prefill(P.url, b)

    # B's handle and secret under A's prompt: refused before any read (B's KV would be another text's)
    _refused(D, decode(D.url, a, pb), "prompt is not the one the remote prefill computed")

    # a handle one off, or A's handle with a secret of zeros: the prefill engine serves neither
    shifted, wrong = copy.deepcopy(pa), copy.deepcopy(pa)
    shifted["kvbridge"]["ctx_request_id"] += 1
    wrong["kvbridge"]["secret"] = "00" * 16
    with ThreadPoolExecutor(2) as pool:
        for r in pool.map(lambda params: decode(D.url, a, params), [shifted, wrong]):
            assert r.status_code >= 400, r.text[:200]
    assert wait_log(D, "RequestNotFound")

    # block ids in NixlConnector's fields are not kvbridge's to read: ignored, A decodes exactly
    with_ids = copy.deepcopy(pa)
    with_ids["remote_block_ids"] = [[1, 2, 3, 4, 5, 6, 7]]
    want = tokens(completion(D.url, a, 8))
    assert tokens(decode(D.url, a, with_ids)) == want
    h = pa["kvbridge"]["ctx_request_id"]
    assert digests(servers.digest_dir("p1"), "ctx", h) == digests(servers.digest_dir("d1"), "gen", h)

    # B, pulled by its rightful holder, still decodes exactly: the forgeries took nothing from it
    assert tokens(decode(D.url, b, pb)) == tokens(completion(D.url, b, 8))
    assert wait_no_blocks_held(D.url) == 0 and wait_no_blocks_held(P.url) == 0


def test_stale_params_of_a_restarted_prefill_engine_fail_by_name(servers):
    P, D = servers.use("p1", "d1")
    p = prompt(300, 3)
    old = prefill(P.url, p)
    P = servers.restart("p1")
    r = decode(D.url, p, old)
    assert r.status_code >= 400, r.text[:200]
    assert wait_log(D, "PeerGone") or wait_log(D, "RequestNotFound"), D.tail()
    assert tokens(decode(D.url, p, prefill(P.url, p))) == tokens(completion(D.url, p, 8))
    assert wait_no_blocks_held(D.url) == 0 and wait_no_blocks_held(P.url) == 0


def test_prefill_killed_between_the_hops_fails_in_bounded_time_and_decode_stays_healthy(servers):
    P, D = servers.use("p1", "d1")
    warm = prompt(50, 4)  # the decode ranks know the prefill ranks already: the failure is a lost peer
    assert tokens(decode(D.url, warm, prefill(P.url, warm)))
    p = prompt(400, 5)
    params = prefill(P.url, p)
    P.kill()
    t0 = time.monotonic()
    r = decode(D.url, p, params)
    took = time.monotonic() - t0
    assert r.status_code >= 400, r.text[:200]
    assert took < 60, f"the decode side took {took:.1f} s to give up on a dead prefill engine"
    assert wait_log(D, "PeerGone") or wait_log(D, "DeadlineExceeded"), D.tail()
    assert tokens(completion(D.url, p, 8))
    assert wait_no_blocks_held(D.url) == 0


def test_clients_that_give_up_leave_no_block_held_and_the_engines_exact(servers):
    """Two clients disconnect mid-request, which vLLM turns into aborts: (A) an early decode waiting for its
    prefill, whose prefill then runs and publishes for a reader that is gone; (B) a sequential decode while it
    pulls (or before it began: 10 ms). The decode engine frees its blocks at once, and so does the prefill
    engine: (A)'s orphaned publish as it publishes (the cancelled pull's Done withdrew its waiting Fetch;
    before, the Fetch was admitted at the publish and the blocks held until the gone reader's lease, 10 s, ran
    out), (B)'s as the decode's cancelled pull reports, or its withdrawal if the pull never began (before, its
    pickup lease: 30 s here); both still answer exactly."""
    P, D = servers.use("p1", "d1")
    describe = describe_of(prefill(P.url, prompt(40, 710)))
    p = prompt(700, 11)
    decode_params, prefill_params = early_params(describe)
    assert gave_up(lambda: completion(D.url, p, 8, kv_transfer_params=decode_params, timeout=0.3))
    time.sleep(0.5)  # vLLM has taken the disconnect
    held = kv_usage(P.url)  # the describe's prefill above: pinned for a reader until its pickup lease (30 s)
    completion(P.url, p, 1, kv_transfer_params=prefill_params).raise_for_status()
    _back_to(P.url, held)  # (A)'s blocks go at its publish, not once the gone reader's lease (10 s) ends
    q = prompt(700, 12)
    params = prefill(P.url, q)
    assert gave_up(lambda: completion(D.url, q, 8, kv_transfer_params=params, timeout=0.01))
    assert wait_no_blocks_held(D.url) == 0
    _back_to(P.url, held)  # (B)'s at once too: its pull cancelled, or withdrawn if it never began (not 30 s)
    c = prompt(300, 14)  # (C) a decode waiting in the decode engine's queue (its 4 sequences taken) when its
    cparams = prefill(P.url, c)  # client goes: its pull never began, so the engine withdraws it (not 30 s)
    with ThreadPoolExecutor(4) as pool:
        busy = [pool.submit(completion, D.url, prompt(20, 40 + i), 900) for i in range(4)]
        time.sleep(1.0)
        assert gave_up(lambda: completion(D.url, c, 8, kv_transfer_params=cparams, timeout=0.5))
        assert not any(f.done() for f in busy), "the decode engine's sequences ended before (C) was aborted"
        _back_to(P.url, held)
        assert all(f.result().status_code == 200 for f in busy)
    assert wait_no_blocks_held(P.url, timeout=60) == 0  # the describe's, at its pickup lease
    r = prompt(300, 13)
    assert tokens(decode(D.url, r, prefill(P.url, r))) == tokens(completion(D.url, r, 8))


def _back_to(url: str, held: float, within: float = 5.0) -> None:
    """The engine's KV use falls back to `held` within `within` seconds (well inside any lease here)."""
    deadline = time.monotonic() + within
    while kv_usage(url) > held and time.monotonic() < deadline:
        time.sleep(0.2)
    assert kv_usage(url) <= held, (kv_usage(url), held)


def gave_up(call) -> bool:
    """Whether the client timed out (closing its connection) before an answer came."""
    try:
        call()
    except httpx.TimeoutException:
        return True
    return False
