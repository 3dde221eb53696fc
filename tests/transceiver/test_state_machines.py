"""The transceiver's four state machines (pull, leg, context peer, published entry): every legal move of each
table is taken through the machine's one `advance`, the happy paths end where the docstrings say, and an
illegal move raises IllegalTransition naming the machine and both states (the state is left unchanged)."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.errors import TransceiverError
from kvbridge.formatter.mapping import Piece
from kvbridge.transceiver.ctx_peer import PEER_MOVES, CtxPeer, PeerState
from kvbridge.transceiver.fsm import IllegalTransition
from kvbridge.transceiver.pull import LEG_MOVES, PULL_MOVES, Leg, LegState, Pull, PullState
from kvbridge.transceiver.send_state import ENTRY_MOVES, Entry, EntryState


def _pull(state: PullState = PullState.HANDSHAKE) -> Pull:
    leg = Leg(0, "tcp://127.0.0.1:1", Piece(0, range(0, 2), range(0, 1)))
    return Pull(7, 70, "ctx", np.arange(3, dtype=np.int64), 40, 1e18, {0: leg}, state=state)


def _leg(state: LegState = LegState.NEW) -> Leg:
    return Leg(1, "tcp://127.0.0.1:2", Piece(1, range(2, 4), range(0, 1)), state=state)


def _peer(state: PeerState = PeerState.NEW) -> CtxPeer:
    return CtxPeer("tcp://127.0.0.1:3", state=state)


def _entry(state: EntryState = EntryState.PUBLISHED) -> Entry:
    return Entry(5, np.arange(2, dtype=np.int64), 20, 4, 1e18, b"s" * 16, state=state)


MACHINES = [  # (name, states enum, transition table, make(state), word in the error)
    ("pull", PullState, PULL_MOVES, _pull, "pull of request 7"),
    ("leg", LegState, LEG_MOVES, _leg, "leg of context rank 1"),
    ("peer", PeerState, PEER_MOVES, _peer, "context peer tcp://127.0.0.1:3"),
    ("entry", EntryState, ENTRY_MOVES, _entry, "request 5"),
]


@pytest.mark.parametrize("name, states, table, make, who", MACHINES, ids=[m[0] for m in MACHINES])
def test_every_listed_move_is_taken_and_every_other_refused_naming_both_states(name, states, table, make, who):
    assert set(table) == set(states), f"{name}: every state has a row"
    for old in states:
        for new in states:
            obj = make(old)
            if new in table[old]:
                obj.advance(new)
                assert obj.state is new
                continue
            with pytest.raises(IllegalTransition) as e:
                obj.advance(new)
            assert obj.state is old  # a refused move changes nothing
            text = str(e.value)
            assert who in text and f"{old} -> {new}" in text, text
            assert isinstance(e.value, TransceiverError)


def test_pull_happy_path_and_failure_drain_once():
    p = _pull()
    for s in (PullState.READ, PullState.CONFIRM, PullState.DONE):
        p.advance(s)
    assert p.result(()).ok and p.terminal
    p = _pull(PullState.READ)
    p.fail("TransferFailed", "first", 1.0)
    p.fail("PeerGone", "second", 1.0)  # draining already: the first error stays
    assert p.state is PullState.DRAIN and (p.error_type, p.error) == ("TransferFailed", "first")
    p.advance(PullState.DONE)
    p.fail("PeerGone", "late", 1.0)
    r = p.result(())
    assert p.state is PullState.DONE and not r.ok and r.error == "first"


def test_done_pull_cannot_go_back_to_read():
    p = _pull(PullState.DONE)
    with pytest.raises(IllegalTransition, match=r"pull of request 7: done -> read is not allowed"):
        p.advance(PullState.READ)


def test_leg_walks_fetch_to_ack_and_retries_a_lost_session_only_before_blocks():
    leg = _leg()
    assert not leg.fetched and not leg.done_sent
    leg.advance(LegState.FETCH_SENT)
    leg.advance(LegState.NEW)  # "no session": Fetch again after a new handshake
    leg.advance(LegState.FETCH_SENT)
    leg.advance(LegState.FETCHED)
    assert leg.fetched and not leg.done_sent
    leg.advance(LegState.DONE_SENT)
    assert leg.fetched and leg.done_sent
    leg.advance(LegState.ACKED)
    with pytest.raises(IllegalTransition, match=r"leg of context rank 1: fetched -> new"):
        _leg(LegState.FETCHED).advance(LegState.NEW)


def test_peer_hello_welcome_refusal_and_reset():
    from kvbridge.transceiver import messages as m

    p = _peer()
    assert p.hello_due(0.0)
    p.hello_sent(10.0)
    assert p.state is PeerState.HELLO and p.first_hello == 10.0 and not p.hello_due(10.5)
    p.hello_sent(11.5)  # unanswered for a second: sent again, first_hello kept
    assert p.first_hello == 10.0 and p.hello_at == 11.5
    p.refused("PeerError", "no agent in common")
    assert p.state is PeerState.FAILED and p.error == ("PeerError", "no agent in common")
    p.hello_sent(13.0)
    w = m.Welcome("ctx", 0, {}, {}, [0], 1, "DRAM", 0, 10.0, "h")
    p.welcomed(w, None, "tcp", "peer-0")
    assert p.state is PeerState.READY and (p.agent_kind, p.peer_name, p.welcome) == ("tcp", "peer-0", w)
    p.forget()
    assert p.state is PeerState.NEW and p.welcome is None and p.agent_kind == "" and p.sock is None


def test_entry_cancel_paths_and_terminal_states():
    e = _entry()
    assert not e.state.terminal
    e.advance(EntryState.READING)
    e.advance(EntryState.CANCELLING)
    assert e.cancel_requested
    e.advance(EntryState.CANCELLED)
    assert e.state.terminal and e.state == "cancelled"  # the SendResult status text
    for end in (EntryState.COMPLETE, EntryState.FAILED, EntryState.EXPIRED, EntryState.CANCELLED):
        assert end.terminal and not ENTRY_MOVES[end]
    with pytest.raises(IllegalTransition, match=r"request 5: published -> complete"):
        _entry().advance(EntryState.COMPLETE)  # nobody read it: it cannot complete
    with pytest.raises(IllegalTransition, match=r"request 5: cancelling -> complete"):
        _entry(EntryState.CANCELLING).advance(EntryState.COMPLETE)
