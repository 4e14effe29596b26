"""The host-retrieval micro-benchmark runs end to end on a tiny shape and refuses bad arguments."""

import json

import pytest

from dual_cache.eval import bench_retrieval

TINY = ["--contexts", "700", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--layers", "3",
        "--distinct-layers", "2", "--repeats", "2", "--budget", "32", "--dtype", "fp32"]
INDEX = ["--options", '{"cluster_min_context": 0}']  # the index even on these short contexts


def test_runs_and_writes_every_column(tmp_path):
    out = tmp_path / "host"
    code = bench_retrieval.main([*TINY, "--batches", "1", "2", "--pools", "1", "2",
                                 "--selectors", "exact", "shortlist", "clusters", *INDEX, "--out", str(out)])
    assert code == 0
    rows = json.loads(out.with_suffix(".json").read_text())
    assert [(r["batch"], r["pool"], r["selector"]) for r in rows] == [
        (b, p, s) for b in (1, 2) for p in (1, 2) for s in ("exact", "shortlist", "clusters")]
    for row in rows:
        assert row["ms_per_layer"] > 0 and row["ms_per_step"] == pytest.approx(row["ms_per_layer"] * 3)
    exact, shortlist, clusters = rows[0], rows[1], rows[2]
    hi = 700 - 64  # positions before the local window
    # exact reads every key; shortlist reads 2 of 16 channels of every key, then 8 × 32 keys whole
    assert exact["key_mib_read_per_step"] * 2**20 == 3 * hi * 2 * 16 * 4
    assert shortlist["key_mib_read_per_step"] * 2**20 == 3 * (hi * 2 + 8 * 32 * 16) * 2 * 4
    # clusters: 2·D summary elements per 16 clustered keys, 8 × 32 shortlisted keys, the unclustered tail
    clustered = hi // 1024 * 1024
    assert clusters["key_mib_read_per_step"] * 2**20 == 3 * (clustered // 16 * 32 + (256 + hi - clustered) * 16) * 8
    assert exact["index_host_bytes"] == 0 and shortlist["index_fraction"] == pytest.approx(0.5, rel=0.01)
    table = out.with_suffix(".md").read_text()
    assert "exact / this" in table and "Thread scaling" in table


def test_index_reads_a_fraction_of_the_keys_on_long_contexts(tmp_path):
    out = tmp_path / "host"
    assert bench_retrieval.main([*TINY[:1], "6000", *TINY[2:], "--repeats", "1", "--selectors", "exact", "clusters",
                                 *INDEX, "--out", str(out)]) == 0
    exact, clusters = json.loads(out.with_suffix(".json").read_text())
    assert clusters["key_mib_read_per_step"] < 0.5 * exact["key_mib_read_per_step"]
    assert 0 < clusters["index_fraction"] < 0.15 and clusters["build_ms_per_1k_tokens"] > 0


def test_shortlist_covering_every_position_reads_every_key(tmp_path):
    out = tmp_path / "host"
    assert bench_retrieval.main([*TINY, "--repeats", "1", "--selectors", "exact", "shortlist",
                                 "--options", '{"shortlist_factor": 100}', "--out", str(out)]) == 0
    exact, shortlist = json.loads(out.with_suffix(".json").read_text())
    assert shortlist["key_mib_read_per_step"] == exact["key_mib_read_per_step"]


def test_bad_arguments_exit_2(capsys):
    assert bench_retrieval.main(["--contexts", "100"]) == 2  # not above window + sink + budget
    assert bench_retrieval.main(["--heads", "6", "--kv-heads", "4"]) == 2
    assert bench_retrieval.main(["--kv-heads", "0"]) == 2
    assert bench_retrieval.main(["--window", "-100"]) == 2
    assert bench_retrieval.main(["--pools", "0"]) == 2
    assert bench_retrieval.main(["--options", '{"cluster_size": 0}']) == 2
    assert bench_retrieval.main(["--options", '{"selector": "exact"}']) == 2
    assert "error:" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_retrieval.main(["--options", "{not json"])


def test_a_batch_over_one_shared_prefix_runs(tmp_path):
    out = tmp_path / "host"
    assert bench_retrieval.main([*TINY[:1], "3000", *TINY[2:], "--repeats", "1", "--batches", "1", "3",
                                 "--selectors", "exact", "clusters", "--shared-prefix", *INDEX,
                                 "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())
    assert all(r["shared_prefix"] for r in rows) and [r["batch"] for r in rows] == [1, 1, 3, 3]
    one, three = rows[1], rows[3]  # clusters at batch 1 and 3: the index is built once, for the one sequence
    assert one["index_host_bytes"] == three["index_host_bytes"]
    # every key of the shared prefix is scanned once for the batch; only the clusters' gathered rows are per sequence
    assert rows[0]["key_mib_read_per_step"] == rows[2]["key_mib_read_per_step"]
    assert one["key_mib_read_per_step"] < three["key_mib_read_per_step"] < 3 * one["key_mib_read_per_step"]
