"""`dual-decoder bench-serve` and `serve` on the command line: a small run writes its table, bad options fail fast."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from dual_cache.cli.main import main
from dual_cache.eval.throughput.bench_serve import workload
from dual_cache.eval.throughput.launch_thread import StepProbe


def test_bench_serve_small_run_writes_rows(tmp_path, capsys):
    out = tmp_path / "serve"
    assert main(["bench-serve", "--requests", "3", "--context", "128", "--rate", "20", "--min-new", "2",
                 "--max-new", "4", "--max-batch", "2", "--systems", "dual", "dense", "static", "--out",
                 str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["system"] for r in rows] == ["dual", "dense", "static"]
    assert all(r["errors"] == 0 and r["output_tokens"] >= 3 * 1 for r in rows)
    assert len({r["output_tokens"] for r in rows}) == 1  # the same greedy requests everywhere
    assert all((r["prompts"], r["temperature"], r["top_p"]) == ("random", 0.0, 1.0) for r in rows)
    assert all(math.isfinite(r["sync_points_per_step"]) and math.isfinite(r["blocked_ms_per_step"]) for r in rows)
    by_system = {r["system"]: r for r in rows}
    assert 0 <= by_system["dual"]["spec_hit_rate"] <= 1 and math.isnan(by_system["dense"]["spec_hit_rate"])
    assert by_system["dense"]["blocked_ms_per_step"] == 0  # DynamicCache rows never wait for a selection
    assert "| dual |" in out.with_suffix(".md").read_text()


def test_bench_serve_natural_prompts_and_sampling(tmp_path):
    out = tmp_path / "serve"
    assert main(["bench-serve", "--requests", "2", "--context", "128", "--rate", "50", "--min-new", "3",
                 "--max-new", "3", "--max-batch", "2", "--systems", "dual", "static", "--prompts", "natural",
                 "--temperature", "0.8", "--top-p", "0.9", "--out", str(out)]) == 0
    record = json.loads(out.with_suffix(".json").read_text())
    assert record["args"]["prompts"] == "natural"
    for row in record["rows"]:
        assert row["errors"] == 0 and (row["prompts"], row["temperature"], row["top_p"]) == ("natural", 0.8, 0.9)
        assert row["sync_points_per_step"] >= 0 and math.isfinite(row["sync_points_per_step"])
        assert row["blocked_ms_per_step"] >= 0 and math.isfinite(row["blocked_ms_per_step"])
        assert 0 <= row["spec_hit_rate"] <= 1
    text = out.with_suffix(".md").read_text()
    assert "natural-text prompts" in text and "sampling at temperature 0.8, top-p 0.9" in text


def test_step_probe_counts_only_when_asked_and_restarts_between_calls():
    counted, uncounted = StepProbe(), StepProbe(count=False)
    for probe in (counted, uncounted):
        with probe.step(None):
            torch.ones(2).sum().item()  # one synchronization point
    assert counted.summary() == {"sync_points_per_step": 1.0, "sync_points_by_op": {"Tensor.item": 1.0},
                                 "blocked_ms_per_step": 0.0}
    assert math.isnan(uncounted.summary()["sync_points_per_step"]) and uncounted.summary()["blocked_ms_per_step"] == 0
    marks = StepProbe()
    marks.mark()
    marks.mark()
    marks.restart()  # the next call's first mark starts afresh: no step spans two calls
    marks.mark()
    assert len(marks.steps) == 1


def test_natural_prompts_need_a_tokenizer():
    args = argparse.Namespace(prompts="natural", seed=0, context=128, shared_prefix=False, requests=2, min_new=1,
                              max_new=2, rate=1.0)
    with pytest.raises(ValueError, match="--prompts natural needs a model with a tokenizer"):
        workload(args, vocab=100, special=set(), tokenizer=None)


@pytest.mark.parametrize("argv, message", [
    (["bench-serve", "--requests", "0"], "--requests must be >= 1"),
    (["bench-serve", "--min-new", "9", "--max-new", "3"], "--max-new must be >= --min-new"),
    (["bench-serve", "--rate", "0"], "--rate must be > 0"),
    (["bench-serve", "--temperature", "-1"], "--temperature must be 0 (greedy) or a finite number"),
    (["bench-serve", "--temperature", "nan"], "--temperature must be 0 (greedy) or a finite number"),
    (["bench-serve", "--temperature", "1e-7"], "--temperature must be 0 (greedy) or a finite number"),
    (["bench-serve", "--temperature", "1", "--top-p", "0"], "--top-p must be in (0, 1]"),
    (["bench-serve", "--temperature", "1", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["bench-serve", "--top-p", "0.9"], "--top-p 0.9 applies to sampling"),
    (["bench-serve", "--prompts", "natural", "--shared-prefix"], "--shared-prefix shares random ids"),
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
