"""The RULER table (eval/quality/ruler_table.py) from hand-made rows: averages over the tasks dense can do, paired
differences from dense, intervals, and where the table goes (eval report, Hub card, README row)."""

import json

import pytest

from dual_cache.eval.card import hub_card
from dual_cache.eval.quality import ruler_table
from dual_cache.eval.quality.report import write_report

MODEL = "org/tiny"


def _rows(scores: dict) -> list[dict]:
    """`{(task, method, budget): [score per sample]}` as harness rows."""
    rows = []
    for (task, method, budget), values in scores.items():
        for sample, score in enumerate(values):
            rows.append({"dataset": "ruler", "task": task, "method": method, "budget": budget, "length": 4096,
                         "sample": sample, "score": float(score), "prediction": "", "reference": ["x"],
                         "device_bytes": 1024, "model": MODEL, "metric": "string_match_all",
                         "cache_config": None if method == "dense" else {"budget": budget}})
    return rows


ROWS = _rows({
    ("niah_single_1", "dense", None): [100, 100, 0, 100],
    ("niah_single_1", "dual", 256): [100, 0, 0, 100],
    ("niah_single_1", "streaming", 256): [0, 0, 0, 0],
    ("vt", "dense", None): [60, 80, 100, 100],
    ("vt", "dual", 256): [60, 80, 100, 100],
    ("vt", "streaming", 256): [20, 20, 20, 20],
    ("cwe", "dense", None): [0, 10, 0, 0],  # dense < 20: shown, not averaged
    ("cwe", "dual", 256): [100, 100, 100, 100],
    ("cwe", "streaming", 256): [0, 0, 0, 0],
})


def test_averages_leave_out_tasks_dense_cannot_do_and_pair_differences():
    (table,) = ruler_table.build_tables(ROWS)
    assert table.tasks == ["niah_single_1", "vt", "cwe"]
    assert table.methods == ["dense", "dual@256", "streaming@256"]
    assert table.averaged == ["niah_single_1", "vt"] and table.excluded == ["cwe"]
    dense, dual = table.average["dense"], table.average["dual@256"]
    assert dense.score == pytest.approx((75 + 85) / 2) and dense.n == 8
    assert dual.score == pytest.approx((50 + 85) / 2)
    assert dual.diff == pytest.approx(-12.5)  # (-25 + 0) / 2, paired per sample
    assert dual.diff_low <= dual.diff <= dual.diff_high <= 0
    cell = table.cells["niah_single_1"]["dual@256"]
    assert cell.low <= cell.score <= cell.high and cell.diff == -25.0 and cell.n == 4
    same = table.cells["vt"]["dual@256"]
    assert (same.diff, same.diff_low, same.diff_high) == (0.0, 0.0, 0.0)  # identical on every sample
    assert table.cells["cwe"]["dual@256"].diff == pytest.approx(97.5)
    again = ruler_table.build_tables(ROWS)[0].average["dual@256"]
    assert (again.low, again.high) == (dual.low, dual.high)  # seeded: the same table every time


def test_markdown_report_card_and_readme_row(tmp_path):
    text = ruler_table.markdown(ROWS)
    assert "| cwe (dense < 20: not averaged) | 4 |" in text
    assert "**average** (2 tasks)" in text and "-12.5 [" in text
    written = write_report(ROWS, str(tmp_path))
    assert str(tmp_path / "ruler_table.md") in written and (tmp_path / "ruler_table.png").stat().st_size > 0
    assert (tmp_path / "ruler_table.md").read_text(encoding="utf-8").startswith("# RULER, method by method")
    card = hub_card.render_card(hub_card.aggregate(ROWS), MODEL, extra=ruler_table.markdown(ROWS, level=3))
    body = str(card)
    assert body.index("### RULER, method by method") < body.index(hub_card.SECTION_END)
    from dual_cache.eval import results_table

    folder = tmp_path / "results" / "eval" / "ruler-table"
    folder.mkdir(parents=True)
    (folder / "tiny-4k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    (row,) = results_table.ruler_averages(str(tmp_path / "results"))
    assert row["baseline"] == "dense 80.0; streaming@256 10.0"
    assert row["dual"].startswith("@256 67.5 (-12.5 [")
    assert "average of the 2 of 3 tasks" in row["measure"] and "n = 4 per task" in row["measure"]


def test_speculation_section_sums_the_dual_rows_that_recorded_it():
    rows = [dict(r) for r in ROWS]
    spec = [r for r in rows if r["method"] == "dual" and r["task"] == "vt"]
    spec[0]["speculation"] = {"spec_hits": 9, "spec_steps": 10, "repairs": 4, "drift_repairs": 0}
    spec[1]["speculation"] = {"spec_hits": 6, "spec_steps": 10, "repairs": 6, "drift_repairs": 1}
    (table,) = ruler_table.build_tables(rows)
    assert table.speculation == {"vt": {"dual@256": (15, 20, 10, 2)}}
    text = ruler_table.markdown(rows)
    assert "| vt | 75% · 0.50 · 2 |" in text and "| niah_single_1 | – |" in text
    assert "Speculation, per task" not in ruler_table.markdown(ROWS)  # no row recorded it: no section
    spec[0]["speculation"] = spec[1]["speculation"] = {"spec_hits": 0, "spec_steps": 0, "repairs": 0}
    assert "Speculation, per task" not in ruler_table.markdown(rows)  # recorded, but no speculated step
