"""Supervision under `kvbridge serve` (issue 14): kill -9 of a context worker with 64 requests in flight, and
of the generation worker mid-request; a worker that hangs (SIGSTOP: running, answering nothing) is killed
after hang_timeout_s, and so is one whose HTTP server answers while its executor's rank is stopped
(`stalled`). Serve keeps running, restarts the dead worker on its port, the router takes it back, and every
pool ends full. Real processes: serve, its workers and router, the openai client."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from kvbridge.serving.supervisor import _TICK_S, PROBE_S

from .cluster import HEADERS, MODEL, PATIENT, PROMPTS, Serve, wait_log, wait_pool_full
from .faults import rank_processes, stopped
from .conftest import MAX_TOKENS

BLOCKS, GEN_BLOCKS = 256, 2048  # the generation pool holds five 2,000-token requests at once
CFG = {
    "model": MODEL,
    "executor": {"num_blocks": BLOCKS, "tokens_per_block": 8, "threads_per_rank": 1, "timeout_s": 120},
    # A pull from a killed context worker fails at its deadline, and a prefilled request whose generation
    # worker was killed before it pulled stays pinned until pickup_timeout_s (until the router releases it
    # at once, issue 14): 20 s and 30 s keep the test short and are still patient.
    "transceiver": {"agent": "tcp", **PATIENT, "transfer_timeout_s": 20, "pickup_timeout_s": 30},
    "router": {"port": 0, "request_timeout_s": 120, "health_interval_s": 0.5},
    "context_servers": {"instances": 2},
    "generation_servers": {"instances": 1, "executor": {"num_blocks": GEN_BLOCKS}},
    "hang_timeout_s": 8,  # probes every 2 s, 1 s each: a loaded worker of this 2-core box still answers
}


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    s = Serve(tmp_path_factory.mktemp("serve"), CFG)
    yield s
    s.stop()


def _client(serve, timeout: float = 120) -> openai.OpenAI:
    return openai.OpenAI(base_url=serve.router + "/v1", api_key="unused", max_retries=0, timeout=timeout)


def _ask(client, i: int) -> dict:
    out = client.completions.create(model=MODEL, prompt=PROMPTS[i % 3], max_tokens=MAX_TOKENS, temperature=0)
    return out.model_extra["kvbridge"]


def _pools_full(serve) -> None:
    for name, blocks in (("ctx0", BLOCKS), ("ctx1", BLOCKS), ("gen0", GEN_BLOCKS)):
        assert wait_pool_full(serve.urls[name], blocks, 1, timeout=90) == [blocks], name


def _back_and_serving(serve, name: str, after: int) -> None:
    """Wait for serve's "is back" line, then until the router sends a request to `name` again (bounded). Until
    the router's own probe has seen the worker answer, a request may get 503 (no such worker healthy): serve's
    supervisor and the router probe separately, and on a loaded host the first probe may time out."""
    wait_log(serve.log, rf"worker {name} is back at", serve.proc, after=after)
    deadline = time.monotonic() + 60
    with _client(serve) as client:
        while True:
            try:
                kb = _ask(client, 0)
            except openai.APIStatusError as e:
                assert e.status_code == 503 and time.monotonic() < deadline, e
                time.sleep(0.5)
                continue
            if name in (kb["context_worker"], kb["generation_worker"]):
                return
            assert time.monotonic() < deadline, f"the router did not send a request to {name} within 60s"


@pytest.mark.slow
def test_kill_9_of_a_context_worker_with_64_in_flight_restarts_it_and_serve_keeps_serving(serve, want):
    old = serve.pid("ctx1")
    answered = threading.Semaphore(0)

    def one(i: int):
        with _client(serve) as client:
            try:
                return _ask(client, i)
            finally:
                answered.release()

    mark = serve.mark()
    with ThreadPoolExecutor(64) as pool:
        futures = [pool.submit(one, i) for i in range(64)]
        assert answered.acquire(timeout=120), "no request was answered within 120s"
        os.kill(old, signal.SIGKILL)  # the other 63 are in flight (or queued at the router)
        outcomes = [f.exception() or f.result() for f in futures]
    wait_log(serve.log, r"context worker ctx1 \(.*\) was killed by signal 9 \(SIGKILL\); restarting it",
             serve.proc, after=mark)
    _back_and_serving(serve, "ctx1", mark)
    assert serve.pid("ctx1") != old and serve.proc.poll() is None
    _pools_full(serve)
    good = [o for o in outcomes if isinstance(o, dict)]
    assert all(o["token_ids"] == want["prompts"][i % 3]
               for i, o in enumerate(outcomes) if isinstance(o, dict))
    failed = [o for o in outcomes if not isinstance(o, dict)]
    assert not failed, f"{len(failed)} of 64 failed (the router retries after handover): {failed[:3]}"
    assert len(good) == 64


@pytest.mark.slow
def test_kill_9_of_the_generation_worker_errors_its_requests_then_it_comes_back(serve, want):
    old, mark = serve.pid("gen0"), serve.mark()
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2000, "temperature": 0}
    with _client(serve) as client:
        stream = client.completions.create(**body, stream=True)
        with ThreadPoolExecutor(4) as pool:
            plain = [pool.submit(client.completions.create, **body) for _ in range(4)]
            next(iter(stream))  # the stream is flowing: the generation worker is busy with all five
            os.kill(old, signal.SIGKILL)
            with pytest.raises(openai.APIError) as e:
                for _ in stream:
                    pass
            assert "generation worker gen0" in str(e.value)
            for f in plain:
                err = f.exception(timeout=120)
                # 502 when caught mid-hop; 503 when the router already saw gen0 down (nothing prefilled)
                assert isinstance(err, openai.APIStatusError) and err.status_code in (502, 503), err
                assert "gen0" in err.message and "generation worker" in err.message
    wait_log(serve.log, r"generation worker gen0 \(.*\) was killed by signal 9", serve.proc, after=mark)
    _back_and_serving(serve, "gen0", mark)
    with _client(serve) as client:
        for i in range(3):
            assert _ask(client, i)["token_ids"] == want["prompts"][i]
    assert serve.pid("gen0") != old and serve.proc.poll() is None
    _pools_full(serve)


@pytest.mark.slow
def test_a_hung_context_worker_is_killed_after_hang_timeout_and_restarted_while_serve_keeps_answering(serve,
                                                                                                     want):
    old, mark = serve.pid("ctx0"), serve.mark()
    os.kill(old, signal.SIGSTOP)  # running, answering nothing: no exit for a plain supervisor to see
    t0 = time.monotonic()
    with _client(serve) as client, ThreadPoolExecutor(4) as pool:
        # meanwhile: served (a prefill caught on ctx0 is retried on ctx1 once ctx0 is killed)
        asked = [pool.submit(_ask, client, i) for i in range(4)]
        silent = wait_log(serve.log, r"context worker ctx0 \(.*\) answered no /health for (\d+)s "
                          r"\(hang_timeout_s=8\); killing it", serve.proc, after=mark)
        took = time.monotonic() - t0
        assert [f.result(timeout=120)["token_ids"] for f in asked] == [want["prompts"][i % 3] for i in range(4)]
    wait_log(serve.log, r"context worker ctx0 \(.*\) was killed by signal 9 \(SIGKILL\); restarting it",
             serve.proc, after=mark)
    # the supervisor counts from the start of its last answered probe (its own count, in the log, is what
    # hang_timeout_s bounds); that start came before the SIGSTOP by up to a probe interval, a loop tick and the
    # probe's own time (at most 1 s)
    earliest = 8 - (PROBE_S + _TICK_S + 1.0)
    assert int(silent.group(1)) >= 8 and earliest <= took < 8 + 10, f"killed {took:.1f}s after the SIGSTOP"
    _back_and_serving(serve, "ctx0", mark)
    assert serve.pid("ctx0") != old and serve.proc.poll() is None
    with _client(serve) as client:
        for i in range(3):
            assert _ask(client, i)["token_ids"] == want["prompts"][i]
    _pools_full(serve)


@pytest.mark.slow
def test_a_worker_whose_rank_is_stopped_answers_stalled_and_is_killed_and_restarted(serve, want):
    """The worker's HTTP server answers; its one rank process does not (SIGSTOP). Its /health says `stalled`
    once the ranks missed half of hang_timeout_s (the router then sends it nothing), serve kills it once they
    missed all of it, and restarts it; requests meanwhile are answered by ctx0."""
    old, mark = serve.pid("ctx1"), serve.mark()
    ranks = rank_processes(old)
    assert len(ranks) == 1, ranks
    with stopped(ranks):
        t0, said = time.monotonic(), None
        while said is None:  # the worker's own report, before serve acts on it
            r = httpx.get(serve.urls["ctx1"] + "/health", headers=HEADERS, timeout=10)
            if r.status_code == 503 and r.json().get("status") == "stalled":
                said = r.json()
            assert time.monotonic() - t0 < 8 + 5, f"no `stalled` from ctx1: {r.status_code} {r.text[:200]}"
            time.sleep(0.2)
        assert said["executor_silent_s"] >= 4 and "answered no probe" in said["error"], said
        with _client(serve) as client:
            for i in range(3):
                kb = _ask(client, i)
                assert kb["token_ids"] == want["prompts"][i] and kb["context_worker"] != "ctx1", kb
        wait_log(serve.log, r"context worker ctx1 \(.*\) answers /health, but its executor's ranks answered nothing "
                 r"for (\d+)s \(hang_timeout_s=8\); killing it", serve.proc, after=mark)
    wait_log(serve.log, r"context worker ctx1 \(.*\) was killed by signal 9 \(SIGKILL\); restarting it",
             serve.proc, after=mark)
    _back_and_serving(serve, "ctx1", mark)
    assert serve.pid("ctx1") != old and serve.proc.poll() is None
    _pools_full(serve)
