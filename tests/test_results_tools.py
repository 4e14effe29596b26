"""The tools that wrote results/ data (formerly scripts inside results/), each run at a tiny size."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import tiny_llama
from dual_cache.eval.quality import full_budget_dtypes, ruler_recall_summary, shared_prefill_from_rows
from dual_cache.eval.selection import lowbit_frontier
from dual_cache.eval.throughput import prefill_index_build, step_profile

ROOT = Path(__file__).resolve().parents[1]


def test_step_profile_splits_a_batched_dual_step():
    ids = step_profile.prompt_ids(None, 96, 200, 2, "random", seed=0)
    assert ids.shape == (2, 200) and int(ids.min()) >= 24 and int(ids.max()) < 72
    row = step_profile.profile_model(tiny_llama(0), ids, new=8, budget=32)
    assert row["batch"] == 2 and row["prompt_tokens"] == 200 and row["steps"] > 0
    assert row["dual_step_ms"] > 0 and row["dense_step_ms"] > 0 and row["waited_ms_per_step"] >= 0
    assert "batch 2" in step_profile.table(row)


def test_prefill_index_build_times_both_selectors():
    row = prefill_index_build.time_prefills(tiny_llama(0), tokens=300, rounds=2, budget=32)
    assert [len(row["seconds"][name]) for name in ("exact", "lowbit")] == [2, 2]
    assert row["best"]["exact"] == min(row["seconds"]["exact"]) > 0
    assert row["lowbit_over_exact"] == pytest.approx(row["best"]["lowbit"] / row["best"]["exact"])


def test_full_budget_dtypes_fp32_paths_agree(capsys):
    assert full_budget_dtypes.count_differences(torch.float32, seeds=1, prompt=40, new=6) == {
        "sdpa-eager": 0, "dual-sdpa": 0, "dual-eager": 0}
    assert full_budget_dtypes.main(["--seeds", "1", "--prompt", "40", "--new", "4"]) == 0
    assert capsys.readouterr().out.strip() == "| float32 | 0/1 | 0/1 | 0/1 |"
    with pytest.raises(SystemExit):
        full_budget_dtypes.main(["--prompt", "4090", "--new", "40"])


def _bench_row(context, selector, ms, mib, channels=0.25, factor=8):
    return {"context": context, "selector": selector, "ms_per_step": ms, "key_mib_read_per_step": mib,
            "options": {"lowbit_channels": channels, "lowbit_factor": factor} if selector == "lowbit" else {}}


def test_lowbit_frontier_joins_time_and_recall(tmp_path, capsys):
    bench = tmp_path / "bench-c0.25-f8.json"
    bench.write_text(json.dumps([_bench_row(1024, "exact", 10.0, 8.0), _bench_row(1024, "lowbit", 4.0, 1.0)]))
    recall = tmp_path / "recall.json"
    default = {"lowbit_channels": 0.25, "lowbit_factor": 8}
    recall.write_text(json.dumps([{"options": {}, "mean": 1.0, "p10": 1.0},
                                  {"options": default, "mean": 0.99, "p10": 0.97}]))
    out = tmp_path / "frontier.md"
    assert lowbit_frontier.main([str(bench), "--recall", f"tiny={recall}", "--out", str(out)]) == 0
    assert "| 0.25 | 8 | 1024 | 1 (12.5%) | 10 | 4.0 | 2.5x | 0.9900 / 0.9700 |" in out.read_text()
    capsys.readouterr()
    with pytest.raises(SystemExit):
        lowbit_frontier.main([str(bench), "--recall", str(recall)])


def test_ruler_recall_summary_orders_tasks(tmp_path, capsys):
    paths = []
    for task, mean in (("fwe", 0.9), ("niah_single_1", 0.99)):
        path = tmp_path / f"tiny-4k-{task}.json"
        path.write_text(json.dumps([{"selector": "exact", "mean": 1.0, "p10": 1.0, "min": 1.0, "topk_share": 0.5},
                                    {"selector": "lowbit", "mean": mean, "p10": 0.8, "min": 0.7, "topk_share": 0.5}]))
        paths.append(str(path))
    assert ruler_recall_summary.main(paths) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    assert rows == ["| niah_single_1 | 0.9900 | 0.8000 | 0.7000 | 50.0% |",
                    "| fwe | 0.9000 | 0.8000 | 0.7000 | 50.0% |"]


def test_shared_prefill_from_rows_fits_fixed_and_per_token_cost(tmp_path):
    rows = [{"method": "dense", "seconds": 1.0 + 0.5 * new, "prefill_seconds": 3.0, "new_tokens": new}
            for new in (2, 4, 6)] + [{"method": "dense", "seconds": 9.0, "new_tokens": 1}]  # no prefill: skipped
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    timings = shared_prefill_from_rows.method_timings([str(path)])
    assert len(next(iter(timings.values()))) == 3
    assert shared_prefill_from_rows.method_timings([str(path)], since=2) != timings
    line = [row for row in shared_prefill_from_rows.table([str(path)]).splitlines() if row.startswith("| dense")]
    assert line and line[0].endswith("| 1.00 | 0.500 |")


CPUINFO = Path("/proc/cpuinfo")
AVX2_GXX = shutil.which("g++") is not None and CPUINFO.exists() and " avx2" in CPUINFO.read_text()


@pytest.mark.skipif(not AVX2_GXX, reason="needs g++ and an AVX2 host (Linux)")
def test_engine_harness_builds_and_prints_a_row(tmp_path):
    binary = tmp_path / "harness"
    subprocess.run(["g++", "-O0", "-std=c++17", "-pthread", "-ffp-contract=off", "-mavx2", "-mfma", "-mf16c", "-mbmi2",
                    f"-I{ROOT}", '-DENGINE="dual_cache/engine/selection_engine.cpp"',
                    str(ROOT / "eval/selection/engine_harness.cpp"), "-o", str(binary)], check=True, cwd=ROOT)
    out = subprocess.run([str(binary), "1024", "1", "1", "8", "8", "1"], check=True, capture_output=True, text=True)
    cells = out.stdout.strip().strip("|").split("|")
    assert [c.strip() for c in cells[:4]] == ["1024", "8", "8", "1"] and float(cells[4]) > 0 and float(cells[5]) > 0
