"""The host-retrieval micro-benchmark runs end to end on a tiny shape and refuses bad arguments."""

import json

from dual_cache.eval import bench_retrieval


def test_runs_and_writes_every_column(tmp_path, capsys):
    out = tmp_path / "host"
    code = bench_retrieval.main(["--contexts", "700", "--batches", "1", "2", "--heads", "4", "--kv-heads", "2",
                                 "--head-dim", "16", "--layers", "3", "--repeats", "2", "--budget", "32",
                                 "--dtype", "fp32", "--out", str(out)])
    assert code == 0
    rows = json.loads(out.with_suffix(".json").read_text())
    assert [(r["batch"], r["selector"]) for r in rows] == [(1, "exact"), (1, "shortlist"), (2, "exact"),
                                                         (2, "shortlist")]
    for row in rows:
        assert row["ms_per_layer"] > 0 and row["ms_per_step"] == row["ms_per_layer"] * 3
    exact, shortlist = rows[0], rows[1]
    # exact reads every key; shortlist reads 2 of 16 channels of every key, then 8 × 32 keys whole
    assert exact["key_mib_read_per_step"] * 2**20 == 3 * 700 * 2 * 16 * 4
    assert shortlist["key_mib_read_per_step"] * 2**20 == 3 * (700 * 2 / 16 + 8 * 32) * 2 * 16 * 4
    assert "exact / this" in out.with_suffix(".md").read_text()


def test_shortlist_covering_every_position_is_reported_as_the_exact_path(tmp_path):
    out = tmp_path / "host"
    assert bench_retrieval.main(["--contexts", "700", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
                                 "--layers", "1", "--repeats", "1", "--budget", "32", "--factor", "100",
                                 "--dtype", "fp32", "--out", str(out)]) == 0
    exact, shortlist = json.loads(out.with_suffix(".json").read_text())
    assert not shortlist["two_stage"] and shortlist["key_mib_read_per_step"] == exact["key_mib_read_per_step"]
    assert "runs the exact selection" in out.with_suffix(".md").read_text()


def test_bad_arguments_exit_2(capsys):
    assert bench_retrieval.main(["--contexts", "100"]) == 2  # not above window + sink + budget
    assert bench_retrieval.main(["--heads", "6", "--kv-heads", "4"]) == 2
    assert bench_retrieval.main(["--kv-heads", "0"]) == 2
    assert bench_retrieval.main(["--window", "-100"]) == 2
    assert "error:" in capsys.readouterr().err
