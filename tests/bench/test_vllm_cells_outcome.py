"""`kvbridge bench vllm-cells`' classification, without vLLM: each kind of answer (exact, wrong, refused, hang,
error) is named as bench/vllm_outcome.py says, a cell's row takes its most serious prompt, the reason of a
refusal comes from the server's log lines (KVBridgeConnector's own line first, else the root exception), and
the rendered table lands between the doc's markers and nowhere else."""

from __future__ import annotations

from kvbridge.bench.vllm_cells import BEGIN, CELLS, END, forge, prompts_of, render, update_doc
from kvbridge.bench.vllm_outcome import LOGPROB_TOL, Answer, Outcome, classify, combine, log_reason

REF, LPS = [5, 6, 7, 8], [-0.5, -1.0, -1.5, -2.0]


def test_equal_tokens_and_logprobs_within_the_tolerance_are_exact():
    o = classify(REF, LPS, Answer(list(REF), [x + LOGPROB_TOL / 2 for x in LPS], 200))
    assert o.kind == "exact" and o.max_dlogprob <= LOGPROB_TOL
    o = classify(REF, LPS, Answer(list(REF), list(LPS), 200, kv_equal=True))
    assert o.kind == "exact" and "KV equal" in o.detail


def test_other_tokens_other_logprobs_or_other_kv_are_wrong():
    o = classify(REF, LPS, Answer([5, 6, 9, 8], list(LPS), 200))
    assert o.kind == "wrong" and "position 2" in o.detail
    o = classify(REF, LPS, Answer(list(REF), [-0.5, -1.07, -1.5, -2.0], 200))
    assert o.kind == "wrong" and "0.07" in o.detail
    assert classify(REF, LPS, Answer(list(REF), [float("nan")] * 4, 200)).kind == "wrong"
    assert classify(REF, LPS, Answer(list(REF), [], 200)).kind == "wrong"
    o = classify(REF, LPS, Answer(list(REF), list(LPS), 200, kv_equal=False, kv_detail="2 of 16 keys differ"))
    assert o.kind == "wrong" and "2 of 16 keys differ" in o.detail


def test_an_error_answer_is_refused_with_the_logs_reason_before_the_clients():
    o = classify(REF, LPS, Answer(status=500, message="HTTP 500: Internal server error",
                                  log_reason="AssertionError: Local block size 32 is not divisible"))
    assert o == Outcome("refused", "AssertionError: Local block size 32 is not divisible")
    o = classify(REF, LPS, Answer(status=400, message="HTTP 400: bad", stage="prefill"))
    assert o.kind == "refused" and o.detail == "prefill hop: HTTP 400: bad"


def test_no_answer_in_time_is_a_hang_and_a_dead_server_an_error():
    o = classify(REF, LPS, Answer(timed_out=True, stage="decode"))
    assert o.kind == "hang" and "decode hop" in o.detail
    o = classify(REF, LPS, Answer(failure="RemoteProtocolError: reset (server http://x exited)"))
    assert o.kind == "error" and "exited" in o.detail


def test_a_cell_takes_its_most_serious_prompt_and_counts_the_rest():
    ex, wr = Outcome("exact", "ok 0", 0.0), Outcome("wrong", "tokens equal, logprobs off by up to 0.07", 0.07)
    outcome, detail = combine([ex, wr, Outcome("exact", "ok 2e-06", 2e-6)])
    assert outcome == "wrong" and detail == "1/3 wrong: tokens equal, logprobs off by up to 0.07; 2/3 exact: ok 2e-06"
    refusals = [Outcome("refused", "RequestNotFound: 7"), Outcome("refused", "prompt differs"),
                Outcome("refused", "RequestNotFound: 7")]
    assert combine(refusals) == ("refused: RequestNotFound: 7; prompt differs", "3/3 refused")
    assert combine([Outcome("refused", "x"), Outcome("hang", "decode hop")]) == (
        "hang", "1/2 hang: decode hop; 1/2 refused: x")
    assert combine([ex])[0] == "exact"
    assert combine([])[0].startswith("error")


def test_log_reason_prefers_kvbridges_line_then_the_root_exception():
    kvb = ("INFO 11-26 00:10:01 [core.py:10] something with Error: not this\n"
           "(EngineCore pid=12) WARNING 11-26 00:10:02 [scheduler.py:121] kvbridge: request cmpl-1: "
           "kv_transfer_params refused: the prompt is not the one the remote prefill computed\n")
    assert log_reason(kvb) == "kv_transfer_params refused: the prompt is not the one the remote prefill computed"
    failed = "ERROR 11-26 00:10:02 [worker.py:105] kvbridge: KV load of request cmpl-2 failed: RequestNotFound: 7\n"
    assert log_reason(failed) == "KV load failed: RequestNotFound: 7"
    nixl = ("(EngineCore pid=7) ERROR 11-26 00:10:03 [core.py:99] Traceback (most recent call last):\n"
            '(EngineCore pid=7) ERROR 11-26 00:10:03 [core.py:99]   File "x.py", line 3, in f\n'
            "(EngineCore pid=7) ERROR 11-26 00:10:03 [core.py:99] AssertionError: Local block size 32 is not "
            "divisible by remote block size 64 or vice versa.\n"
            "(EngineCore pid=7) ERROR 11-26 00:10:03 [core.py:99] RuntimeError: later, not the root\n")
    assert log_reason(nixl).startswith("AssertionError: Local block size 32 is not divisible")
    assert log_reason("INFO 11-26 00:10:01 [a.py:1] ValueError: an info line\n") == ""
    assert len(log_reason("ERROR 11-26 00:10:01 [a.py:1] ValueError: " + "x" * 999, limit=50)) == 50


def test_forgeries_edit_what_each_connector_reads():
    nixl = {"remote_block_ids": [[3, 4, 5]], "remote_engine_id": "e"}
    assert forge("nixl", 0, nixl, {})["remote_block_ids"] == [[4, 5, 6]]
    assert forge("nixl", 1, nixl, {})["remote_block_ids"] == [[5, 4, 3]]
    assert nixl["remote_block_ids"] == [[3, 4, 5]]  # the original is not edited
    mine = {"kvbridge": {"ctx_request_id": 1, "secret": "aa"}}
    other = {"kvbridge": {"ctx_request_id": 2, "secret": "bb"}}
    assert forge("kvbridge", 0, mine, other)["kvbridge"] == {"ctx_request_id": 2, "secret": "aa"}
    assert forge("kvbridge", 1, mine, other) == other
    forged = next(c for c in CELLS if c.forged)
    assert all(len(p) > 64 and o is not None and p != o for _, p, o, _ in prompts_of(forged, [16, 300, 700]))


def test_the_table_goes_between_the_markers_only(tmp_path):
    rows = [{"cell": "TP1 -> TP1", "connector": c, "outcome": o, "detail": d}
            for c, o, d in (("nixl", "wrong", "a|b"), ("kvbridge", "refused: why", ""))]
    text = render(rows, "note")
    assert "| TP1 -> TP1 | **refused**: why | **wrong** (a\\|b) |" in text
    assert text.index("KVBridgeConnector") < text.index("NixlConnector")
    doc = tmp_path / "d.md"
    doc.write_text(f"before\n{BEGIN}\nold table\n{END}\nafter\n")
    assert update_doc(str(doc), text)
    new = doc.read_text()
    assert new.startswith("before\n") and new.endswith(f"{END}\nafter\n") and "old table" not in new
    assert "**refused**: why" in new
    (tmp_path / "none.md").write_text("no markers\n")
    assert not update_doc(str(tmp_path / "none.md"), text)
    assert (tmp_path / "none.md").read_text() == "no markers\n"
