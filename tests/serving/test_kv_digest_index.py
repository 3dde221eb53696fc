"""A worker's handle -> request index for the positional KV check (serving/worker_state.DigestIndex): bounded,
the oldest handles (and their kept answers) go first, and an answer is kept only for a handle it knows."""

from __future__ import annotations

from kvbridge.serving.worker_state import DigestIndex


def test_the_index_keeps_the_last_handles_and_answers_and_forgets_the_oldest():
    ix = DigestIndex(limit=3, kept=2)
    for h in (11, 12, 13, 14):
        ix.add(h, h * 10)
    assert [ix.request_of(h) for h in (11, 12, 13, 14)] == [None, 120, 130, 140]
    ix.keep(11, {"handle": 11})  # forgotten: not kept
    for h in (12, 13, 14):
        ix.keep(h, {"handle": h})
    assert [ix.answer(h) for h in (11, 12, 13, 14)] == [None, None, {"handle": 13}, {"handle": 14}]
    ix.add(15, 150)  # 12 goes; 13's answer stays with 13
    assert ix.request_of(12) is None and ix.answer(13) == {"handle": 13}
    ix.add(13, 131)  # a handle seen again (a retried handover): the new request, its old answer dropped
    assert ix.request_of(13) == 131 and ix.answer(13) is None
