"""When one rank's transfer fails and another's succeeds, the aborted request must carry the failure's reason.

Found by the soak (bench/soak_requests.py): a generation request ended "aborted" with error text that was
the transfer STATS of rank 0 ({"bytes": ..., "ms": ...}). HookTally.add (executor/hooks.py) keeps one note
per request, the lowest rank's: rank 0 reported kv_ready with its stats note, rank 1 reported abort with
"KV transfer failed (...)", and rank 0's note won. Fixed: a note sent with an abort outranks notes sent with
kv_ready (keep the lowest rank among the ranks that reported the abort).
"""

from __future__ import annotations


from kvbridge.executor.runtime import Executor
from kvbridge.executor.transceiver_hook import context_endpoints, disagg_params, hooked_executor_config

XCFG = {"agents": ["nixl"], "transfer_timeout_s": 20, "handshake_timeout_s": 2, "pickup_timeout_s": 3}


def _exec(tmp_path, role) -> Executor:
    run_dir = tmp_path / role
    run_dir.mkdir()
    return Executor.start(
        hooked_executor_config(
            role, f"{role}-instance", run_dir, XCFG, model="seeded:tiny3", pp=2, num_blocks=32, tokens_per_block=8,
            timeout_s=90,
        )
    )


def test_a_request_aborted_by_one_ranks_failed_pull_reports_that_failure(tmp_path):
    with _exec(tmp_path, "context") as ctx, _exec(tmp_path, "generation") as gen:
        endpoints = context_endpoints(str(tmp_path / "context"), 2)
        res = ctx.prefill(list(range(10, 30)))
        # PP2 -> PP2: generation rank 0 reads only context rank 0, rank 1 only rank 1, whose address is dead
        params = disagg_params(ctx, res.request_id, (endpoints[0], "tcp://127.0.0.1:9"))
        rid = gen.submit(
            list(range(10, 30)),
            max_tokens=4,
            mode="generation_only",
            first_token=res.first_token,
            ctx_info={"disagg_params": params.to_dict()},
        )
        c = gen.wait(rid, timeout=60)
        assert c.finish_reason == "aborted"
        assert "KV transfer failed (PeerGone)" in c.error, c.error
        assert gen.free_blocks(timeout=30) == [32, 32]
