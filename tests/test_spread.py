"""Benchmarks report spread (eval/spread.py): runs interleave the methods round by round, a cell reports the median
and min–max of its runs, and a loaded host is named in the output."""

from __future__ import annotations

import math

import pytest

from dual_cache.eval import spread
from dual_cache.eval.throughput import bench, bench_report
from dual_cache.eval.throughput.bench_cell import empty_row
from dual_cache.eval.throughput.bench_grid import BenchGrid


def test_rotated_turns_each_group_by_the_round():
    cells = [("a", 1), ("b", 1), ("c", 1), ("a", 2), ("b", 2)]
    group = lambda c: c[1]  # noqa: E731
    assert spread.rotated(cells, 0, group) == cells
    assert spread.rotated(cells, 1, group) == [("b", 1), ("c", 1), ("a", 1), ("b", 2), ("a", 2)]
    assert spread.rotated(cells, 3, group) == [("a", 1), ("b", 1), ("c", 1), ("b", 2), ("a", 2)]


def test_merge_runs_reports_the_median_and_the_range_and_keeps_failures():
    runs = [{"error": None, "tok_s": v, "bytes": 7} for v in (3.0, 1.0, 2.0)]
    row = spread.merge_runs(runs, ["tok_s", "absent"])
    assert (row["tok_s"], row["tok_s_min"], row["tok_s_max"], row["repeats"], row["bytes"]) == (2.0, 1.0, 3.0, 3, 7)
    assert spread.with_range(row, "tok_s") == "2.00 (1.00–3.00)"
    assert spread.with_range({"tok_s": 2.0}, "tok_s") == "2.00" and spread.with_range({}, "tok_s") == "—"
    failed = spread.merge_runs([runs[0], {"error": "host memory", "tok_s": math.nan}], ["tok_s"])
    assert failed["error"] == "host memory"
    assert math.isnan(spread.summary([None, math.nan])["median"])


def test_load_warning_only_past_the_cores():
    assert spread.load_warning(1.9, 2) is None and spread.load_warning(math.nan, 2) is None
    assert "load average reached 2.5 on 2 cores" in spread.load_warning(2.5, 2)


def test_bench_runs_every_cell_each_round_with_the_methods_rotated(monkeypatch):
    order = []

    def fake_cell(model, prompts, method, context, batch, budget, grid, **kwargs):
        order.append(method)
        speed = {"dense": 10.0, "dual-none": 5.0}[method] + len(order)  # every run differs
        row = empty_row(method, context, batch, budget, grid)
        row.update(prefill_s=0.1, decode_tokens_per_s=speed, ms_per_step=1000 / speed, device_bytes_per_request=1.0)
        return row

    monkeypatch.setattr(bench, "run_cell", fake_cell)
    monkeypatch.setattr(bench, "weight_bytes", lambda model: 0)
    monkeypatch.setattr(bench, "PromptSource", lambda *args, **kwargs: None)
    monkeypatch.setattr(spread, "load_average", lambda: 9.0)

    class Model:
        device = __import__("torch").device("cpu")
        dtype = "float32"

        class config:
            @staticmethod
            def get_text_config(decoder=True):
                return type("C", (), {"vocab_size": 96})

    grid = BenchGrid(methods=("dense", "dual-none"), contexts=(64,), budgets=(16,), new_tokens=4, warmup_steps=1)
    lines = []
    result = bench.run_bench(Model(), None, grid, repeats=3, log=lines.append)
    assert order[2:] == ["dense", "dual-none", "dual-none", "dense", "dense", "dual-none"]  # after the warm-ups
    dense = next(r for r in result.cells if r["method"] == "dense")
    assert dense["repeats"] == 3 and dense["decode_tokens_per_s_min"] < dense["decode_tokens_per_s_max"]
    assert any(line.startswith("warning: the 1-minute load average") for line in lines)
    text = bench_report.render_markdown(result)
    assert "median (min–max) of 3 interleaved run(s)" in text and "warning: the 1-minute load average" in text
    with pytest.raises(ValueError, match="repeats"):
        bench.run_bench(Model(), None, grid, repeats=0)
