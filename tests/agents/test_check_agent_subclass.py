"""Issue 27: a custom agent without traps. A subclass may name its own state `_lock`, `_peers`, `_regions`,
`_closed`, `_next_key` (the base class keeps its own under `_kvb_` names), and a peer process that cannot
start is reported ONCE: with its traceback when it raised, with every thread's stack when it hangs.
"""

from __future__ import annotations

import pytest

from .test_check_agent import check_agent

AGENTS = "tests.agents.subclass_agents"


@pytest.mark.slow
def test_a_subclass_with_its_own_lock_peers_regions_closed_next_key_passes_every_check():
    from kvbridge.agents.conformance import CHECKS

    code, rows, out = check_agent(f"{AGENTS}:OwnNamesAgent")
    assert code == 0, out
    assert rows == {c.name: "PASS" for c in CHECKS}, out


def test_the_base_state_names_cannot_collide():
    from tests.agents.subclass_agents import OwnNamesAgent

    a = OwnNamesAgent("x")
    try:
        assert {"_kvb_lock", "_kvb_peers", "_kvb_regions", "_kvb_closed", "_kvb_next_key"} <= set(vars(a))
        assert a._closed == "not a bool" and not a._kvb_closed
    finally:
        a.close()
    assert a._closed == "closed" and a._kvb_closed


def test_a_peer_that_raises_is_reported_once_with_its_traceback():
    code, rows, out = check_agent(f"{AGENTS}:RaisesInPeerAgent", "--timeout", "10")
    assert code == 1, out
    assert rows["setup"] == "FAIL" and set(rows.values()) == {"FAIL", "NOT RUN"}, out
    assert out.count("RuntimeError: peer-side constructor failed on purpose") == 1, out
    assert "Traceback (most recent call last)" in out and "subclass_agents.py" in out, out


@pytest.mark.slow
def test_a_peer_that_hangs_is_reported_once_with_where_it_hangs():
    code, rows, out = check_agent(f"{AGENTS}:HangsInPeerAgent", "--timeout", "5", "--start-timeout", "10")
    assert code == 1, out
    assert rows["setup"] == "FAIL" and set(rows.values()) == {"FAIL", "NOT RUN"}, out
    assert out.count("peer process hangs") == 1, out
    assert "hang_here_forever" in out and "_register" in out, out
