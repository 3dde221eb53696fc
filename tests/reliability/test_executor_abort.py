"""A client abort of a generation-only request whose KV is still being pulled must stop the pull before the
executor reuses its blocks. Real executors (rank processes, ZeroMQ, NIXL) and the seeded tiny model."""

from __future__ import annotations

import time


from kvbridge.executor.runtime import Executor, ExecutorConfig
from kvbridge.executor.transceiver_hook import context_endpoints, disagg_params, hooked_executor_config

XCFG = {"agents": ["nixl"], "transfer_timeout_s": 60, "handshake_timeout_s": 30}
P1 = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]  # 13 tokens: 2 blocks of 8
P2 = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9]
FILL = [(7 * i) % 250 + 1 for i in range(239)]  # 30 blocks of 8, finished at once: moves the free list on


def _exec(tmp_path, role, **kw) -> Executor:
    run_dir = tmp_path / role
    run_dir.mkdir()
    return Executor.start(
        hooked_executor_config(
            role, f"{role}-instance", run_dir, XCFG, model="seeded:tiny3", timeout_s=90, tokens_per_block=8, **kw
        )
    )


def test_abort_while_the_kv_is_being_pulled_never_lets_the_pull_write_into_reused_blocks(tmp_path):
    """A waits for context request 1000 (not prefilled yet) in blocks [0, 1]; the client aborts A, its blocks
    go back to the free list, B gets them and starts a long decode; then request 1000 is prefilled. The
    engine's abort sent only a "free" op: no hook was told, so A's pull is still alive, fetches 1000 and
    writes P1's KV over B's prompt KV mid-decode. B's tokens then differ from aggregated decoding of P2.

    Fixed: an abort of a request in state awaiting_kv tells every rank's hook (a new hook call, e.g.
    on_abort(request_id) -> CacheTransceiver.cancel_request) and keep the blocks reserved until every rank's
    hook reported the pull finished ("abort" after the receiver drained); only then the "free" op."""
    with Executor.start(ExecutorConfig(model="seeded:tiny3", num_blocks=64, tokens_per_block=8)) as agg:
        want = agg.generate([P2], max_tokens=150, stop_ids=())[0]
    with (
        _exec(tmp_path, "context", num_blocks=64) as ctx,
        _exec(tmp_path, "generation", num_blocks=32) as gen,
    ):
        endpoints = context_endpoints(str(tmp_path / "context"), 1)

        def params(ctx_rid):
            return {
                "disagg_params": disagg_params(ctx, ctx_rid, endpoints).to_dict()
            }

        a = gen.add_generation(P1, 1, max_tokens=3, ctx_info=params(1000))
        assert a.block_ids == (0, 1)
        gen.abort(a.request_id)
        assert gen.wait(a.request_id, timeout=30).finish_reason == "aborted"
        # A's blocks come back only once every rank's pull of request 1000 has settled (cancelled)
        deadline = time.monotonic() + 30
        while gen.free_blocks() != [32] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gen.free_blocks() == [32]
        gen.generate([FILL], max_tokens=1, stop_ids=())  # takes blocks 2..31 and frees them behind 0, 1
        y = ctx.prefill(P2)
        b = gen.add_generation(P2, y.first_token, max_tokens=150, stop_ids=(), ctx_info=params(y.request_id))
        assert b.block_ids == (0, 1)  # A's blocks
        ctx.prefill(P1, request_id=1000)  # A's pull, if still alive, now reads this into B's blocks
        got = gen.wait(b.request_id, timeout=60)
        assert got.finish_reason == "length", got
        assert got.tokens == want, "B's KV was overwritten by the pull of the aborted request A"
        assert gen.free_blocks(timeout=30) == [32]
