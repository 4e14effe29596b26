"""The host-retrieval micro-benchmark runs end to end on a tiny shape and refuses bad arguments."""

import json

import pytest

from dual_cache.eval.selection import bench_retrieval, profile_selection

TINY = ["--contexts", "700", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--layers", "3",
        "--distinct-layers", "2", "--repeats", "2", "--budget", "32", "--dtype", "fp32"]


def test_runs_and_writes_every_column(tmp_path):
    out = tmp_path / "host"
    code = bench_retrieval.main([*TINY, "--batches", "1", "2", "--pools", "1", "2", "--threads", "1", "2",
                                 "--selectors", "exact", "lowbit", "torch-exact", "--out", str(out)])
    assert code == 0
    rows = json.loads(out.with_suffix(".json").read_text())
    assert [(r["batch"], r["pool"], r["torch_threads"], r["selector"]) for r in rows] == [
        (b, p, t, s) for b in (1, 2) for p, t in ((1, 1), (1, 2), (2, 1)) for s in ("exact", "lowbit", "torch-exact")]
    for row in rows:
        assert row["ms_per_layer"] > 0 and row["ms_per_step"] == pytest.approx(row["ms_per_layer"] * 3)
        assert row["host_share"] == pytest.approx(row["effective_gbps"] / row["host_read_gbps"])
        assert row["distinct_layers"] == 2
    exact, lowbit, torch_exact = rows[0], rows[1], rows[2]
    hi = 700 - 64  # positions before the local window: 9 complete 64-token groups, a tail of 60
    # exact reads every key (through the engine or in torch ops alike)
    assert exact["key_mib_read_per_step"] * 2**20 == 3 * hi * 2 * 16 * 4
    assert torch_exact["key_mib_read_per_step"] == exact["key_mib_read_per_step"] and torch_exact["engine"] == "torch"
    # lowbit: per group and KV head the codes of 1 of 4 channel quads (64 bytes) and every parameter (16 × 4 bytes),
    # then 8 × 32 shortlisted keys and the tail whole
    assert lowbit["key_mib_read_per_step"] * 2**20 == 3 * 2 * (9 * (64 + 16 * 4) + (8 * 32 + 60) * 16 * 4)
    assert exact["index_host_bytes"] == 0 and 0 < lowbit["index_fraction"] < 0.1
    table = out.with_suffix(".md").read_text()
    assert "exact / this" in table and "share of host" in table
    assert "Thread scaling" in table and "Pool scaling" in table


def test_index_reads_a_fraction_of_the_keys_on_long_contexts(tmp_path):
    out = tmp_path / "host"
    assert bench_retrieval.main([*TINY[:1], "6000", *TINY[2:], "--repeats", "1", "--selectors", "exact", "lowbit",
                                 "--out", str(out)]) == 0
    exact, lowbit = json.loads(out.with_suffix(".json").read_text())
    assert lowbit["key_mib_read_per_step"] < 0.5 * exact["key_mib_read_per_step"]
    assert 0 < lowbit["index_fraction"] < 0.15 and lowbit["build_ms_per_1k_tokens"] > 0


def test_an_index_whose_shortlist_covers_every_position_reads_every_key(tmp_path):
    out = tmp_path / "host"
    assert bench_retrieval.main([*TINY, "--repeats", "1", "--selectors", "exact", "lowbit",
                                 "--options", '{"lowbit_factor": 100}', "--out", str(out)]) == 0
    exact, lowbit = json.loads(out.with_suffix(".json").read_text())
    assert lowbit["key_mib_read_per_step"] == exact["key_mib_read_per_step"]


def test_distinct_layers_fit_the_memory_limit(tmp_path):
    out = tmp_path / "host"
    # one layer of 700 tokens x 2 KV heads x 16 channels of fp32 K/V is ~180 KB: a 0.0003 GiB limit leaves 1 layer
    assert bench_retrieval.main([*TINY, "--repeats", "1", "--selectors", "lowbit", "--memory-gib", "0.0003",
                                 "--out", str(out)]) == 0
    assert [r["distinct_layers"] for r in json.loads(out.with_suffix(".json").read_text())] == [1]


def test_bad_arguments_exit_2(capsys):
    assert bench_retrieval.main(["--contexts", "100"]) == 2  # not above window + sink + budget
    assert bench_retrieval.main(["--heads", "6", "--kv-heads", "4"]) == 2
    assert bench_retrieval.main(["--kv-heads", "0"]) == 2
    assert bench_retrieval.main(["--window", "-100"]) == 2
    assert bench_retrieval.main(["--pools", "0"]) == 2
    assert bench_retrieval.main(["--threads", "0"]) == 2
    assert bench_retrieval.main(["--memory-gib", "0"]) == 2
    assert bench_retrieval.main(["--selectors", "lowbit", "--options", '{"lowbit_factor": 0}']) == 2
    assert bench_retrieval.main(["--options", '{"cluster_size": 16}']) == 2  # an option of a retired selector
    assert bench_retrieval.main(["--options", '{"selector": "exact"}']) == 2
    assert "error:" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_retrieval.main(["--options", "{not json"])
    assert bench_retrieval.main(["--selectors", "clusters"]) == 2  # not a selector any more
    assert bench_retrieval.main(["--selectors", 'carried:{"rescan_interval": 0}']) == 2
    assert bench_retrieval.main(["--selectors", "carried:[1]"]) == 2


def test_selector_specs_with_their_own_options_run_side_by_side(tmp_path):
    out = tmp_path / "specs"
    assert bench_retrieval.main([*TINY[:1], "3000", *TINY[2:], "--repeats", "4", "--selectors", "lowbit",
                                 'carried:{"rescan_interval": 2, "rescan_cosine": null}', "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())
    shares = {r["selector"]: r["scan_share"] for r in rows}
    assert shares["lowbit"] == 1.0 and 0.3 < shares['carried:{"rescan_interval": 2, "rescan_cosine": null}'] < 0.8


def test_a_batch_over_one_shared_prefix_runs(tmp_path):
    out = tmp_path / "host"
    assert bench_retrieval.main([*TINY[:1], "3000", *TINY[2:], "--repeats", "1", "--batches", "1", "3",
                                 "--selectors", "exact", "torch-exact", "--shared-prefix", "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())
    assert all(r["shared_prefix"] for r in rows) and [r["batch"] for r in rows] == [1, 1, 3, 3]
    # every key of the shared prefix is scanned once for the whole batch
    assert len({r["key_mib_read_per_step"] for r in rows}) == 1


def test_the_selection_profile_runs_and_splits_a_call_into_its_parts(tmp_path):
    out = tmp_path / "profile"
    assert profile_selection.main(["--contexts", "2000", "--batches", "1", "2", "--threads", "1", "2", "--heads", "4",
                                   "--kv-heads", "2", "--head-dim", "16", "--budget", "32", "--layers", "2",
                                   "--repeats", "1", "--flush-mib", "1", "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())
    assert [(r["batch"], r["threads"], r["selector"]) for r in rows] == [
        (b, t, s) for b in (1, 2) for t in (1, 2) for s in ("lowbit", "exact")]
    for row in rows:
        parts = row["parts"]
        assert row["engine_ms"] > 0 and row["key_bytes_read"] == parts["scan"]["bytes"] + parts["exact_reads"]["bytes"]
        if row["selector"] == "lowbit":  # 2000 - 64 positions: 30 groups of 64 scanned, 8 x 32 rescored + the tail
            assert parts["scan"]["thread_ms"] > 0 and parts["shortlist"]["thread_ms"] > 0
            assert parts["exact_reads"]["bytes"] == row["batch"] * 2 * (8 * 32 + 1936 - 30 * 64) * 16 * 2
        else:  # exact: no scan, every key
            assert parts["scan"]["bytes"] == 0 and parts["exact_reads"]["bytes"] == row["batch"] * 2 * 1936 * 16 * 2
    assert "exact reads" in out.with_suffix(".md").read_text()
    assert profile_selection.main(["--contexts", "100"]) == 2
