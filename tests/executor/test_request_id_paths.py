"""Request ids chosen by the caller (real rank processes, seeded:tiny3): a duplicate of an id still in use is
refused by `submit` itself, naming the id, and the request that holds the id is untouched (before the fix, the
engine's refusal of the duplicate reached the first request's waiter, which then saw its own request fail);
an id is free again once its request ended; automatic ids step over explicit ones in use."""

from __future__ import annotations

import time

import pytest

from kvbridge.errors import ExecutorError
from kvbridge.executor.runtime import Executor, ExecutorConfig

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
BLOCKS = 64


def test_a_duplicate_request_id_is_refused_at_submit_and_the_request_holding_it_finishes_exactly():
    cfg = ExecutorConfig(model="seeded:tiny3", num_blocks=BLOCKS, tokens_per_block=8, timeout_s=60)
    with Executor.start(cfg) as ex:
        want = ex.wait(ex.submit(PROMPT, max_tokens=40, stop_ids=()), timeout=60).tokens
        assert ex.submit(PROMPT, max_tokens=40, stop_ids=(), request_id=1000) == 1000
        t0 = time.monotonic()
        with pytest.raises(ExecutorError, match="^request id 1000 is already in use$"):
            ex.submit(PROMPT[:5], max_tokens=5, stop_ids=(), request_id=1000)
        assert time.monotonic() - t0 < 1.0  # refused here, not by a round trip through the ranks
        auto = ex.submit(PROMPT, max_tokens=2, stop_ids=(), request_id=None)
        assert auto != 1000
        done = ex.wait(1000, timeout=60)
        assert done.finish_reason == "length" and done.tokens == want, done
        ex.wait(auto, timeout=60)
        again = ex.wait(ex.submit(PROMPT, max_tokens=40, stop_ids=(), request_id=1000), timeout=60)
        assert again.tokens == want  # the id is free once its request ended
        nxt = 1 + max(auto, 1)  # the next automatic id, taken explicitly and held: the automatic one skips it
        ex.submit(PROMPT, max_tokens=40, stop_ids=(), request_id=nxt)
        assert ex.submit(PROMPT, max_tokens=2, stop_ids=()) not in (nxt,)
        assert ex.wait(nxt, timeout=60).tokens == want
        assert ex.free_blocks(timeout=30) == [BLOCKS]
