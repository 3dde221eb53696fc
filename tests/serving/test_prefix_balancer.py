"""The prefix_aware policy: a conversation's turns go to one worker, conversations spread, load wins when the
chosen worker is much busier, a request without a key is least-loaded; routing keys from every prompt form."""

from __future__ import annotations

from kvbridge.serving.balancer import PREFIX_KEY_TOKENS, PREFIX_LOAD_SLACK, Pool, WorkerRef, routing_key
from kvbridge.serving.config import parse_config


def _pool(n=4):
    workers = [WorkerRef(f"w{i}", f"http://h:{i}", "context", healthy=True) for i in range(n)]
    return Pool(workers, "prefix_aware")


def test_turns_of_one_conversation_stick_and_conversations_spread():
    pool = _pool()
    system = list(range(40))
    picks = {}
    for conv in range(32):
        first = system + [1000 + conv] * 30
        names = {pool.pick(key=routing_key({"prompt": first + [7] * (10 * turn)})).name for turn in range(4)}
        assert len(names) == 1  # every turn keys on the same leading tokens
        picks[conv] = names.pop()
    assert len(set(picks.values())) == 4


def test_a_busy_worker_loses_affinity_and_a_dead_one_only_moves_its_own_keys():
    pool = _pool()
    keys = [routing_key({"prompt": [i] * 80}) for i in range(40)]
    home = {k: pool.pick(key=k).name for k in keys}
    busy = next(w for w in pool.workers if w.name == home[keys[0]])
    busy.in_flight = PREFIX_LOAD_SLACK
    assert pool.pick(key=keys[0]).name != busy.name
    busy.in_flight = 0
    busy.mark(False, "down")
    moved = [k for k in keys if pool.pick(key=k).name != home[k]]
    assert moved and all(home[k] == busy.name for k in moved)


def test_requests_without_a_key_go_to_the_least_loaded_worker():
    pool = _pool(3)
    pool.workers[0].in_flight, pool.workers[1].in_flight = 2, 1
    assert pool.pick(key=None).name == "w2"
    assert pool.pick({"w2"}, key=None).name == "w1"


def test_routing_keys_of_token_text_and_chat_prompts():
    long = list(range(PREFIX_KEY_TOKENS + 10))
    assert routing_key({"prompt": long}) == routing_key({"prompt": long[:PREFIX_KEY_TOKENS] + [5]})
    assert routing_key({"prompt": [long]}) == routing_key({"prompt": long})
    assert routing_key({"prompt": "hello"}) != routing_key({"prompt": "help"})
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert routing_key({"messages": msgs}) == routing_key({"messages": msgs})
    assert routing_key({"prompt": []}) is None and routing_key([1, 2]) is None and routing_key({}) is None


def test_the_serving_config_accepts_prefix_aware_and_turns_block_reuse_on_by_default():
    off = {"instances": 1, "executor": {"enable_block_reuse": False}}
    cfg = parse_config({"model": "seeded:tiny", "router": {"policy": "prefix_aware"},
                        "context_servers": {"instances": 1}, "generation_servers": off})
    assert cfg.router.policy == "prefix_aware"
    assert cfg.context[0].executor_config("seeded:tiny", "i", "/tmp").enable_block_reuse is True
    assert cfg.generation[0].executor_config("seeded:tiny", "i", "/tmp").enable_block_reuse is False
