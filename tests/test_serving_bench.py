"""`dual-decoder bench-serve` and `serve` on the command line: a small run writes its table, bad options fail fast."""

from __future__ import annotations

import json

import pytest

from dual_cache.cli import main


def test_bench_serve_small_run_writes_rows(tmp_path, capsys):
    out = tmp_path / "serve"
    assert main(["bench-serve", "--requests", "3", "--context", "128", "--rate", "20", "--min-new", "2",
                 "--max-new", "4", "--max-batch", "2", "--systems", "dual", "dense", "static", "--out",
                 str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["system"] for r in rows] == ["dual", "dense", "static"]
    assert all(r["errors"] == 0 and r["output_tokens"] >= 3 * 1 for r in rows)
    assert len({r["output_tokens"] for r in rows}) == 1  # the same greedy requests everywhere
    assert "| dual |" in out.with_suffix(".md").read_text()


@pytest.mark.parametrize("argv, message", [
    (["bench-serve", "--requests", "0"], "--requests must be >= 1"),
    (["bench-serve", "--min-new", "9", "--max-new", "3"], "--max-new must be >= --min-new"),
    (["bench-serve", "--rate", "0"], "--rate must be > 0"),
    (["serve", "--max-batch", "0"], "--max-batch must be >= 1"),
])
def test_bad_options_fail_before_loading_a_model(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_cache_config_must_be_a_json_object_of_fields(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--cache-config", "{\"budget\": -3}"])
    assert "budget" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--cache-config", "[1, 2]"])
    assert "JSON object" in capsys.readouterr().err
