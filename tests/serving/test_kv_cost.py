"""kv_aware's cost on constructed indexes (deterministic: no workers, no events in flight): the generation hop
weighs the prompt it already holds before load, a candidate that would need a context hop pays for it, a
conversation's next turn goes where its history lives (and is prefilled there when the tail is short), and
load still wins when the cached worker is busy enough. Live routing is in test_kv_routing.py."""

from __future__ import annotations

import random

import pytest
from kvbridge.executor.kv_events import BlockStored, KVEventBatch
from kvbridge.kvcache.prefix_tree import chain_keys

from .cluster import MODEL, PATIENT, TOKEN

TPB = 8
CFG = {
    "model": MODEL,
    "executor": {"num_blocks": 64, "tokens_per_block": TPB, "threads_per_rank": 1, "timeout_s": 60},
    "transceiver": {"agent": "tcp", "handshake_timeout_s": 3, **PATIENT},
    "router": {"port": 0, "request_timeout_s": 60, "policy": "kv_aware"},
    "context_servers": {"instances": 2, "tp": 1},
    "generation_servers": {"instances": 2, "tp": 1},
}
RNG = random.Random(26)
SYSTEM = [RNG.randrange(1, 256) for _ in range(64)]        # 8 blocks, shared by every conversation
TURN1 = SYSTEM + [RNG.randrange(1, 256) for _ in range(16)]  # + a user turn and its answer: 10 blocks


@pytest.fixture
def routing(monkeypatch):
    """A KvRouting over 2 context + 2 generation workers whose index the test writes directly."""
    from kvbridge.serving.auth import TOKEN_ENV
    from kvbridge.serving.balancer import Pool, WorkerRef
    from kvbridge.serving.config import parse_config
    from kvbridge.serving.kv_policy import KvRouting

    made = []

    def make(**kv_aware):
        monkeypatch.setenv(TOKEN_ENV, TOKEN)
        kv = KvRouting(parse_config({**CFG, "router": {**CFG["router"], "kv_aware": kv_aware}}))
        made.append(kv)
        ctx = Pool([WorkerRef(n, f"http://{n}", "context", True) for n in ("ctx0", "ctx1")], "kv_aware")
        gen = Pool([WorkerRef(n, f"http://{n}", "generation", True) for n in ("gen0", "gen1")], "kv_aware")
        for w in ("ctx0", "ctx1", "gen0", "gen1"):
            kv.index.add_worker(w, "fp", TPB, "i")
        return kv, ctx, gen

    yield make
    for kv in made:
        kv.close()


def _holds(kv, worker: str, tokens: list[int]) -> None:
    """`worker` confirmed every full block of `tokens` (as its KV events would say)."""
    keys = chain_keys("fp", tokens, TPB)
    n = len(keys)
    kv.index.apply(worker, kv.index.info(worker).seq + 1,
                   KVEventBatch(0.0, (BlockStored(tuple(keys), None, tuple(tokens[:n * TPB]), TPB),)))


def _load(pool, **in_flight) -> None:
    for w in pool.workers:
        w.in_flight = in_flight.get(w.name, 0)


def test_at_equal_cost_the_generation_hop_picks_the_worker_holding_more_of_the_prompt(routing):
    kv, ctx, gen = routing()  # local prefill off: cost = blocks lacking x pull + in flight x decode
    prompt = TURN1 + [RNG.randrange(1, 256) for _ in range(16)]  # 96 tokens, 12 blocks
    _holds(kv, "gen0", TURN1)   # the conversation: lacks 2 blocks
    _holds(kv, "gen1", SYSTEM)  # the system prompt only: lacks 4 blocks
    _load(gen, gen0=1)          # 2 x 1 + 2 x 1 = 4 = 4 x 1 + 2 x 0
    w, d = kv.pick(gen, "generation", prompt, healthy_only=True, context=ctx)
    assert d["candidates"]["gen0"]["cost"] == d["candidates"]["gen1"]["cost"] == 4.0
    assert w.name == "gen0" and "context_cost" not in d["candidates"]["gen1"]  # off: no context pricing
    _load(gen, gen0=2)  # now the load outweighs the two blocks (another turn: gen0 holds this one speculatively)
    w, d = kv.pick(gen, "generation", TURN1 + [RNG.randrange(1, 256) for _ in range(16)], healthy_only=True,
                   context=ctx)
    assert w.name == "gen1" and d["candidates"]["gen0"]["cost"] == 6.0


def test_a_generation_candidate_that_needs_a_context_hop_pays_for_it(routing):
    kv, ctx, gen = routing(local_prefill_tokens=32)
    prompt = TURN1 + [RNG.randrange(1, 256) for _ in range(32)]  # 112 tokens, 14 blocks
    _holds(kv, "gen0", TURN1)   # tail 32 tokens: may prefill it itself
    _holds(kv, "gen1", SYSTEM)  # tail 48 tokens: needs the context hop
    _holds(kv, "ctx0", SYSTEM)  # the cheapest context hop: 6 blocks to prefill
    _load(gen, gen0=3, gen1=1)  # pull + decode alone: gen0 4 + 6 = 10 > gen1 6 + 2 = 8
    w, d = kv.pick(gen, "generation", prompt, healthy_only=True, context=ctx)
    c = d["candidates"]
    assert c["gen1"]["context_cost"] == 6.0 and c["gen1"]["cost"] == 8.0 + 6.0
    assert c["gen0"]["local_tail_tokens"] == 32 and c["gen0"]["cost"] == 4 * 1.0 + 3 * 2.0
    assert w.name == "gen0"
    route = {"generation": d}
    assert kv.local_prefill(route) and route["local_prefill"] == {"tail_tokens": 32}


def test_when_both_could_prefill_locally_the_shorter_tail_wins_at_equal_load_cost(routing):
    kv, ctx, gen = routing(local_prefill_tokens=32)
    prompt = TURN1 + [RNG.randrange(1, 256) for _ in range(16)]  # 96 tokens: gen1's tail is exactly 32
    _holds(kv, "gen0", TURN1)
    _holds(kv, "gen1", SYSTEM)
    _load(gen, gen0=1)  # 2 blocks + 2 = 4 blocks + 0: a tie, which the held prompt breaks
    w, d = kv.pick(gen, "generation", prompt, healthy_only=True, context=ctx)
    assert {n: c["local_tail_tokens"] for n, c in d["candidates"].items()} == {"gen0": 16, "gen1": 32}
    assert w.name == "gen0"
    route = {"generation": d}
    assert kv.local_prefill(route) and route["local_prefill"] == {"tail_tokens": 16}


def test_a_busy_generation_worker_still_loses_its_conversation_to_an_idle_one(routing):
    kv, ctx, gen = routing(local_prefill_tokens=32)
    prompt = TURN1 + [RNG.randrange(1, 256) for _ in range(32)]  # 112 tokens
    _holds(kv, "gen0", TURN1)
    _holds(kv, "ctx1", TURN1)  # a context worker holds the history too: its hop costs 4 blocks
    _load(gen, gen0=8)         # 4 + 16 = 20 > gen1: 14 pulled + 0 + 4 = 18
    w, d = kv.pick(gen, "generation", prompt, healthy_only=True, context=ctx)
    assert w.name == "gen1" and d["candidates"]["gen1"]["context_cost"] == 4.0
    route = {"generation": d}
    assert not kv.local_prefill(route) and "local_prefill" not in route
    c, dc = kv.pick(ctx, "context", prompt)  # and the context hop then goes where the history is
    assert c.name == "ctx1" and dc["hit_tokens"] == 80


def test_at_equal_cost_the_context_hop_picks_the_worker_holding_more_of_the_prompt(routing):
    kv, ctx, _gen = routing()
    prompt = TURN1 + [RNG.randrange(1, 256) for _ in range(16)]  # 12 blocks
    _holds(kv, "ctx0", SYSTEM)  # lacks 4, idle: 4
    _holds(kv, "ctx1", TURN1)   # lacks 2, 2 requests in flight: 2 + 2 x 1 = 4
    _load(ctx, ctx1=2)
    w, d = kv.pick(ctx, "context", prompt)
    assert d["candidates"]["ctx0"]["cost"] == d["candidates"]["ctx1"]["cost"] == 4.0 and w.name == "ctx1"


def test_the_decision_the_answer_shows_carries_no_private_fields(routing):
    kv, ctx, gen = routing(local_prefill_tokens=32)
    _holds(kv, "gen0", TURN1)
    _, d = kv.pick(gen, "generation", TURN1 + [1, 2, 3], healthy_only=True, context=ctx)
    assert all(not k.startswith("_") for c in d["candidates"].values() for k in c), d


def test_a_prefix_held_only_speculatively_is_not_prefilled_by_the_generation_worker(routing):
    kv, ctx, gen = routing(local_prefill_tokens=32)
    first = SYSTEM + [RNG.randrange(1, 256) for _ in range(12)]
    w, d = kv.pick(gen, "generation", first, healthy_only=True, context=ctx)  # nothing held: gen0, in turn
    assert w.name == "gen0" and not kv.local_prefill({"generation": d})
    second = SYSTEM + [RNG.randrange(1, 256) for _ in range(12)]  # the same system prompt, just routed to gen0
    w, d = kv.pick(gen, "generation", second, healthy_only=True, context=ctx)
    g0 = d["candidates"]["gen0"]
    assert g0["spec_tokens"] == 64 and g0["hit_tokens"] == 0 and "local_tail_tokens" not in g0
    route = {"generation": d}
    assert w.name == "gen0" and not kv.local_prefill(route)  # its KV may still be on its way: a context hop
    _holds(kv, "gen0", SYSTEM)  # once its events confirm the blocks, the 12-token tail is prefilled there
    w, d = kv.pick(gen, "generation", SYSTEM + [RNG.randrange(1, 256) for _ in range(12)], healthy_only=True,
                   context=ctx)
    route = {"generation": d}
    assert w.name == "gen0" and kv.local_prefill(route) and route["local_prefill"] == {"tail_tokens": 12}
