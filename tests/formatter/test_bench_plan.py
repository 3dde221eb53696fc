"""`kvbridge bench plan` runs end to end on a short request and writes its JSON rows (no timing asserted)."""

from __future__ import annotations

import json

from kvbridge.bench import plan


def test_bench_plan_writes_a_row_per_case_and_checks_its_plans_against_the_baseline(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert plan.main(["--tokens", "48", "--repeat", "1", "--blocks", "contiguous", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["case"] for r in rows] == [c[0] for c in plan.CASES]
    for r in rows:
        assert {"case", "fragments", "coalesced", "plan_ms"} <= set(r) and r["coalesced"] <= r["fragments"]
    ident = rows[-1]
    assert ident["coalesced"] == 1 and ident["fragments"] == 3  # 3 whole blocks, adjacent on both sides
    assert "plan building" in capsys.readouterr().out
