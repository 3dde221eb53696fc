"""Whether a worker id's record in the registry still belongs to a live worker (registration.Registrar._stale),
with httpx's transport standing in for the old record's URL: a kvbridge worker proves its incarnation in its
/health; a vLLM server (vllm_member.py) cannot, so one that answers at another URL is live (a second member
under that id is a duplicate) and one at the new member's own URL is the server it just started."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvbridge.serving.registration import Registrar
from kvbridge.serving.registry.records import WorkerRecord, encode

KEY = b"k" * 32


def _rec(url: str, incarnation: str) -> WorkerRecord:
    return WorkerRecord("c", "d-a", "generation", url, "m", incarnation, 1)


def _stale(old: WorkerRecord, mine_url: str, answer) -> bool:
    def handler(req: httpx.Request) -> httpx.Response:
        if answer is None:
            raise httpx.ConnectError("refused", request=req)
        return answer

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            reg = Registrar(None, KEY, _rec(mine_url, "new"), 1.0, 4.0)
            return await reg._stale(http, encode(old, KEY))

    return asyncio.run(go())


@pytest.mark.parametrize("old_url, answer, stale", [
    ("http://h:2", httpx.Response(200, content=b""), False),           # a vLLM server answering elsewhere: live
    ("http://h:1", httpx.Response(200, content=b""), True),            # at our URL: the server we started
    ("http://h:2", None, True),                                        # nothing answers there
    ("http://h:2", httpx.Response(503, content=b""), True),
    ("http://h:2", httpx.Response(200, json={"instance": "old"}), False),   # a kvbridge worker, that incarnation
    ("http://h:2", httpx.Response(200, json={"instance": "other"}), True),  # another incarnation answers now
])
def test_a_record_is_stale_unless_its_url_still_answers_for_it(old_url, answer, stale):
    assert _stale(_rec(old_url, "old"), "http://h:1", answer) is stale
