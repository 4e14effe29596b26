"""The evaluation harness end to end on a tiny random-weight model: rows, resume, fidelity, report, kvpress merge."""

import json
import os

import pytest
import torch

from dual_cache import DualDecoderConfig
from dual_cache.eval.card import kvpress_runner
from dual_cache.eval.card.kvpress_merge import export_prompts, merge_kvpress
from dual_cache.eval.quality import fidelity, harness
from dual_cache.eval.quality.generation import generate
from dual_cache.eval.quality.methods import make_method, parse_method, standard_methods
from dual_cache.eval.quality.report import write_report
from tests.test_eval_support import char_tokenizer, tiny_model

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "longbench")


@pytest.fixture(scope="module")
def setup():
    return tiny_model(seed=3), char_tokenizer()


@pytest.fixture(scope="module")
def items(setup):
    _, tok = setup
    gen = harness.ruler_items(tok, ["niah_single_1"], [700], 1, max_new_tokens=4)
    gen += harness.longbench_items(tok, ["trec", "lcc"], 2048, data_dir=FIXTURE, limit=1, max_new_tokens=4)
    fid = harness.fidelity_items(tok, [400], 1, forced_tokens=8, greedy_tokens=6)
    return gen, fid


def test_end_to_end_rows_resume_report(setup, items, tmp_path):
    model, tok = setup
    gen, fid = items
    methods = [make_method("dense"), make_method("dual", 16), make_method("streaming")]
    out = str(tmp_path / "rows.jsonl")
    rows = harness.run(model, tok, methods, out, "tiny", gen, fid, progress=False)
    assert len(rows) == len(gen) * 3 + 2 * 3
    for row in rows:
        assert set(harness.ROW_KEYS) <= set(row)
        assert 0 <= row["score"] <= 100 and isinstance(row["length"], int)
        assert isinstance(row["reference"], list) and isinstance(row["device_bytes"], int)
    by = {(r["dataset"], r["task"], r["method"]): r for r in rows}
    assert by[("ruler", "niah_single_1", "dense")]["budget"] is None
    assert by[("ruler", "niah_single_1", "streaming")]["budget"] == 0
    assert by[("longbench", "trec", "dual")]["metric"] == "classification"
    assert by[("longbench", "trec", "dense")]["length"] == 2048  # the window bucket; prompt_tokens is the prompt's
    assert by[("longbench", "trec", "dense")]["prompt_tokens"] <= 1500  # LongBench's maximum length for a 2K window
    # predictions are the decoded text, not stripped (LongBench scores code lines with their indentation)
    result = generate(model, tok, gen[0].input_ids, make_method("dense"), 6)
    assert result.text == tok.decode(result.new_ids, skip_special_tokens=True)
    assert by[("ruler", "niah_single_1", "dense")]["prediction"] == tok.decode(result.new_ids[:4], skip_special_tokens=True)
    # dense bytes grow with the prompt; streaming keeps sink + window only
    assert by[("ruler", "niah_single_1", "streaming")]["device_bytes"] < by[("ruler", "niah_single_1", "dense")]["device_bytes"]
    dense_fid = by[("fidelity", "teacher_forced_top1", "dense")]
    assert dense_fid["score"] == 100.0 and dense_fid["kl"] == 0.0 and dense_fid["identical_tokens"] == 6
    # resume: nothing left to do; the file holds each row once
    assert harness.run(model, tok, methods, out, "tiny", gen, fid, progress=False) == []
    assert len(harness.read_rows(out)) == len(rows)
    paths = write_report(harness.read_rows(out), str(tmp_path / "report"))
    assert [os.path.basename(p) for p in paths] == ["summary.md", "score_vs_budget.png", "fidelity_vs_budget.png",
                                                    "ruler_table.md", "ruler_table.png"]  # RULER rows: the table
    summary = open(paths[0], encoding="utf-8").read()
    assert "| dual | 16 |" in summary and "Fidelity to dense" in summary


def test_teacher_forcing_full_budget_matches_dense(setup, items):
    model, tok = setup
    item = items[1][0]
    dense = fidelity.forced_run(model, tok, item, make_method("dense"), item.continuation)
    assert dense.tokens[: len(item.continuation)] == item.continuation  # forcing works
    full = make_method("dual", 4096)  # everything resident: must equal dense
    run = fidelity.forced_run(model, tok, item, full, item.continuation + dense.tokens[len(item.continuation):])
    cmp = fidelity.compare(dense, run, len(item.continuation))
    assert cmp["kl"] < 1e-6 and cmp["top1"] == 1.0 and cmp["identical_tokens"] == item.greedy_tokens
    assert torch.allclose(dense.logits, run.logits, atol=1e-4)


def test_methods_and_errors(setup, items, tmp_path):
    model, tok = setup
    labels = [m.label for m in standard_methods([64, 128])]
    assert labels == ["dense", "dual@64", "dual@128", "dual-no-repair@256", "dual-none@256", "oracle@256",
                      "streaming@0", "quest@256"]
    assert parse_method("oracle", 128).cache_config == {"budget": 128, "selector": "oracle"}
    assert parse_method("dual@32", 256).cache_config == {"budget": 32}  # the library's defaults
    assert parse_method("dual-sync-repair", 64).cache_config == {"budget": 64, "miss_repair": True, "fetch_factor": 1,
                                                                  "fetch_next": False, "coupled_sampling": False}
    assert parse_method("dual-no-repair", 64).cache_config == {"budget": 64, "miss_repair": False, "fetch_factor": 1,
                                                                "fetch_next": False}
    with pytest.raises(ValueError, match="unknown method"):
        parse_method("h2o", 256)
    with pytest.raises(ValueError, match="positive integer budget"):
        make_method("dual", 0)
    with pytest.raises(ValueError, match="include the 'dense'"):
        harness.run(model, tok, [make_method("dual", 16)], str(tmp_path / "x.jsonl"), "tiny", (), items[1])
    with pytest.raises(ValueError, match="duplicate"):
        harness.run(model, tok, [make_method("dense")] * 2, str(tmp_path / "x.jsonl"), "tiny", items[0])


def test_kvpress_export_and_merge_on_a_fake_runner_file(items, tmp_path):
    gen, _ = items
    prompts = str(tmp_path / "prompts.jsonl")
    export_prompts(gen, prompts, "tiny")
    exported = harness.read_rows(prompts)
    assert exported[0]["input_ids"] == gen[0].input_ids
    # the runner cannot import dual_cache: the file carries the dual cache's sink and window
    assert (exported[0]["n_sink"], exported[0]["window"]) == (DualDecoderConfig.n_sink, DualDecoderConfig.window)
    fake = str(tmp_path / "kvpress.jsonl")
    ruler_ref = gen[0].references[0]
    with open(fake, "w", encoding="utf-8") as handle:
        for budget, prediction in ((64, f"it is {ruler_ref}"), (256, "no idea")):
            handle.write(json.dumps({"dataset": "ruler", "task": gen[0].task, "length": gen[0].length, "sample": 0,
                                     "method": "kvpress-snapkv", "budget": budget, "prediction": prediction,
                                     "device_bytes": 1000, "compression_ratio": 0.5, "new_tokens": 3}) + "\n")
        handle.write(json.dumps({"dataset": "longbench", "task": "trec", "length": gen[1].length, "sample": 0,
                                 "method": "kvpress-streaming", "budget": 64, "prediction": "Individual",
                                 "device_bytes": 1000}) + "\n")
    out = str(tmp_path / "rows.jsonl")
    assert merge_kvpress(prompts, fake, out) == 3
    rows = harness.read_rows(out)
    assert [r["score"] for r in rows] == [100.0, 0.0, 100.0]
    assert rows[0]["model"] == "tiny" and rows[0]["reference"] == [ruler_ref]
    assert merge_kvpress(prompts, fake, out) == 0  # idempotent
    with open(fake, "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"dataset": "ruler", "task": "vt", "length": 1, "sample": 0, "method": "kvpress-x",
                                 "budget": 1, "prediction": ""}) + "\n")
    with pytest.raises(ValueError, match="no exported prompt"):
        merge_kvpress(prompts, fake, out)
    assert kvpress_runner.compression_ratio(1000, 256, 4, 64) == pytest.approx(1 - 324 / 1000)
    assert kvpress_runner.compression_ratio(100, 256, 4, 64) == 0.0


def test_cli_rejects_bad_input_before_loading(capsys):
    from dual_cache.cli.main import main

    assert main(["eval", "run", "--samples", "0"]) == 2
    assert "--samples" in capsys.readouterr().err
    assert main(["eval", "run", "--ruler-tasks", "niah_bogus"]) == 2
    assert main(["eval", "run", "--methods", "dual@x"]) == 2
    assert main(["eval", "report", "--results", "/nonexistent/rows.jsonl"]) == 2
