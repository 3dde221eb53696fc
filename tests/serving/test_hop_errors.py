"""The two failure shapes of one hop (serving/relay.py), with httpx's transport as the fault injector: a
context hop retries a connection closed under it once, fresh, and otherwise raises the caller's "try
another worker" error naming the worker and why; a generation step maps a timeout to the client's 504 and a
broken connection to its 502 (the worker marked down), naming the worker."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvbridge.serving.balancer import WorkerRef
from kvbridge.serving.protocol import ApiError
from kvbridge.serving.relay import RERUN_CODES, context_send, from_worker


class Client:
    """The client's side of the router's request: it stays connected."""

    async def is_disconnected(self) -> bool:
        return False


class HopFailed(Exception):
    pass


def faulty(*faults):
    """A client whose n-th request raises faults[n] (an exception class) or, past them, answers 200."""
    calls = []

    def handler(req: httpx.Request) -> httpx.Response:
        calls.append(req)
        if len(calls) <= len(faults):
            raise faults[len(calls) - 1]("injected", request=req)
        return httpx.Response(200, json={"n": len(calls)})

    return httpx.AsyncClient(transport=httpx.MockTransport(handler)), calls


def run(coro):
    return asyncio.run(coro)


def worker() -> WorkerRef:
    return WorkerRef("ctx0", "http://127.0.0.1:9", "context", healthy=True)


@pytest.mark.parametrize("fault", [httpx.RemoteProtocolError, httpx.ReadError])
def test_a_context_hop_retries_a_connection_closed_under_it_once_and_keeps_the_worker(fault):
    async def go():
        client, calls = faulty(fault)
        async with client:
            r = await context_send(Client(), w, 5.0, lambda: client.post(w.url + "/x"), HopFailed)
        return r, calls

    w = worker()
    r, calls = run(go())
    assert r.status_code == 200 and len(calls) == 2 and w.healthy


def test_a_context_hop_closed_twice_fails_naming_the_worker_and_marks_it_down():
    async def go():
        client, calls = faulty(httpx.RemoteProtocolError, httpx.RemoteProtocolError)
        async with client:
            with pytest.raises(HopFailed, match=r"^ctx0: RemoteProtocolError injected$"):
                await context_send(Client(), w, 5.0, lambda: client.post(w.url + "/x"), HopFailed)
        return calls

    w = worker()
    assert len(run(go())) == 2 and not w.healthy and w.last_error == "RemoteProtocolError"


@pytest.mark.parametrize("fault,why,down", [(httpx.ReadTimeout, "no answer within 2.5s", False),
                                            (httpx.ConnectError, "ConnectError injected", True)])
def test_a_context_hop_that_times_out_or_cannot_connect_is_not_retried(fault, why, down):
    async def go():
        client, calls = faulty(fault)
        async with client:
            with pytest.raises(HopFailed, match=f"^ctx0: {why}$"):
                await context_send(Client(), w, 2.5, lambda: client.post(w.url + "/x"), HopFailed)
        return calls

    w = worker()
    assert len(run(go())) == 1 and w.healthy is not down


@pytest.mark.parametrize("fault,status,code,down", [
    (httpx.ReadTimeout, 504, "timeout", False),
    (httpx.ConnectError, 502, "generation_unreachable", True),
    (httpx.ReadError, 502, "generation_failed", True)])
def test_a_generation_step_maps_each_failure_to_the_clients_error_naming_the_worker(fault, status, code,
                                                                                    down):
    async def go():
        client, _ = faulty(fault)
        async with client:
            with pytest.raises(ApiError) as e:
                await from_worker(Client(), client.post(w.url + "/x"), w, "decode server",
                                  "did not answer in 1s")
        return e.value

    w = worker()
    e = run(go())
    assert (e.status, e.code) == (status, code) and e.message.startswith("decode server ctx0 "), e.message
    assert w.healthy is not down


@pytest.mark.parametrize("fault,code", [(httpx.ConnectError, "generation_unreachable"),
                                        (httpx.ReadError, "generation_dropped"),
                                        (httpx.RemoteProtocolError, "generation_dropped")])
def test_a_send_that_breaks_before_any_answer_is_a_code_the_routers_run_again(fault, code):
    async def go():
        client, _ = faulty(fault)
        async with client:
            with pytest.raises(ApiError) as e:
                await from_worker(Client(), client.post(w.url + "/x"), w, "generation worker",
                                  "did not answer in 1s", sending=True)
        return e.value

    w = worker()
    e = run(go())
    assert (e.status, e.code) == (502, code) and code in RERUN_CODES and not w.healthy
    assert e.message.startswith("generation worker ctx0 failed"), e.message
