"""Sampled decoding in the evaluation harness (eval/quality/sampling.py): rows carry the settings and the sample seed,
their keys never meet greedy ones, a seed reproduces its tokens, every method of a (prompt, seed) starts from the same
random state (shared prefill or not), and the RULER table pairs sampled rows by (prompt, seed)."""

import json

import numpy as np
import pytest
import torch

from dual_cache.eval.quality import harness, ruler_table
from dual_cache.eval.quality.generation import generate
from dual_cache.eval.quality.methods import parse_method
from dual_cache.eval.quality.report import write_report
from dual_cache.eval.quality.sampling import Sampling, settings_text, torch_seed
from tests.test_eval_support import char_tokenizer, tiny_model

SAMPLING = Sampling(temperature=0.7, top_p=0.9, seeds=2)
SETTINGS = {"temperature": 0.7, "top_p": 0.9, "top_k": 0}


@pytest.fixture(scope="module")
def setup():
    model, tok = tiny_model(seed=3), char_tokenizer()
    items = harness.ruler_items(tok, ["niah_single_1"], [700], 1, max_new_tokens=6)
    return model, tok, items


def _methods():
    return [parse_method(spec, 16) for spec in ("dense", "dual@16")]


def test_rows_carry_the_settings_and_never_share_keys_with_greedy_rows(setup, tmp_path):
    model, tok, items = setup
    out = str(tmp_path / "rows.jsonl")
    sampled = harness.run(model, tok, _methods(), out, "tiny", items, progress=False, sampling=SAMPLING)
    assert [(r["method"], r["sample_seed"]) for r in sampled] == [("dense", 0), ("dual", 0), ("dense", 1), ("dual", 1)]
    for row in sampled:
        assert row["sampling"] == SETTINGS
        assert row["torch_seed"] == torch_seed(items[0].input_ids, row["sample_seed"])
    # greedy rows into the same file: none of them is taken for a sampled one, and they carry no sampling fields
    greedy = harness.run(model, tok, _methods(), out, "tiny", items, progress=False)
    assert len(greedy) == 2 and not any({"sampling", "sample_seed", "torch_seed"} & set(r) for r in greedy)
    keys = [harness.row_key(r) for r in sampled + greedy]
    assert len(set(keys)) == 6
    assert harness.row_key(greedy[0]) == harness.row_key({**sampled[0], "sampling": None})  # same but the sampling
    assert len(harness.row_key(greedy[0])) == 8  # unchanged for greedy rows (results files before sampling)
    # other settings are other rows; resuming the same ones writes nothing
    hotter = harness.run(model, tok, _methods()[:1], out, "tiny", items, progress=False,
                         sampling=Sampling(temperature=1.0, seeds=1))
    assert len(hotter) == 1 and hotter[0]["sampling"] == {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
    assert harness.run(model, tok, _methods(), out, "tiny", items, progress=False, sampling=SAMPLING) == []
    assert harness.run(model, tok, _methods(), out, "tiny", items, progress=False) == []
    assert len(harness.read_rows(out)) == 7


def test_a_seed_reproduces_its_tokens_per_method(setup):
    model, tok, items = setup
    ids = items[0].input_ids
    hot = Sampling(temperature=1.5)
    for method in _methods():
        first = generate(model, tok, ids, method, 24, sampling=hot, seed=11, min_new_tokens=24)
        again = generate(model, tok, ids, method, 24, sampling=hot, seed=11, min_new_tokens=24)
        other = generate(model, tok, ids, method, 24, sampling=hot, seed=12, min_new_tokens=24)
        assert first.new_ids == again.new_ids, method.label
        assert first.new_ids != other.new_ids, method.label  # it does sample
    with pytest.raises(ValueError, match="needs a seed"):
        generate(model, tok, ids, _methods()[0], 4, sampling=hot)


def test_every_method_starts_from_the_same_seed(setup, tmp_path, monkeypatch):
    """A spy on `model.generate` records the random state each call starts from and its sampling arguments (with
    the shared prefill; stand-alone runs sample the same tokens: the next test)."""
    model, tok, items = setup
    calls = []
    real = model.generate

    def spy(*args, **kwargs):
        calls.append((torch.random.get_rng_state().clone(), {k: kwargs.get(k) for k in SETTINGS},
                      kwargs.get("do_sample")))
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "generate", spy)
    methods = _methods() + [parse_method("streaming@16", 16)]
    rows = harness.run(model, tok, methods, str(tmp_path / "rows.jsonl"), "tiny", items, progress=False,
                       sampling=SAMPLING)
    assert len(calls) == len(rows) == 6
    for (state, kwargs, do_sample), row in zip(calls, rows):
        assert kwargs == SETTINGS and do_sample is True  # top-k 0 passed explicitly, not transformers' 50
        expected = torch.random.manual_seed(row["torch_seed"]).get_state()
        assert torch.equal(state, expected), (row["method"], row["sample_seed"])
    by_seed = {}
    for (state, _, _), row in zip(calls, rows):
        by_seed.setdefault(row["sample_seed"], []).append(state)
    assert all(torch.equal(states[0], s) for states in by_seed.values() for s in states)  # dense, dual, streaming
    assert not torch.equal(by_seed[0][0], by_seed[1][0])  # seed 0 and seed 1 differ


def test_shared_prefill_samples_the_tokens_of_stand_alone_runs(setup, tmp_path):
    model, tok, items = setup
    hot = Sampling(temperature=1.2, top_k=40, seeds=2)
    methods = _methods() + [parse_method("oracle@16", 16)]
    shared = harness.run(model, tok, methods, str(tmp_path / "a.jsonl"), "tiny", items, progress=False, sampling=hot)
    alone = harness.run(model, tok, methods, str(tmp_path / "b.jsonl"), "tiny", items, progress=False, sampling=hot,
                        shared_prefill=False)
    assert [(r["method"], r["sample_seed"], r["prediction"]) for r in shared] == \
        [(r["method"], r["sample_seed"], r["prediction"]) for r in alone]
    assert len({r["prediction"] for r in shared if r["method"] == "dense"}) == 2  # the two seeds drew differently


def test_bad_sampling_options_are_refused_before_loading(capsys):
    from dual_cache.cli.main import main

    for argv, message in [(["--top-p", "0.9"], "add --temperature"), (["--sampling-seeds", "2"], "add --temperature"),
                          (["--temperature", "0"], "temperature must be > 0"),
                          (["--temperature", "0.7", "--top-p", "1.5"], "top-p must be in"),
                          (["--temperature", "0.7", "--top-k", "-1"], "top-k must be"),
                          (["--temperature", "0.7", "--sampling-seeds", "0"], "seeds must be"),
                          (["--temperature", "0.7", "--suites", "fidelity"], "without --temperature")]:
        assert main(["eval", "run", *argv]) == 2, argv
        assert message in capsys.readouterr().err, argv
    assert settings_text(SETTINGS) == "temperature 0.7, top-p 0.9, top-k off"
    assert settings_text({"temperature": 1.0, "top_p": 1.0, "top_k": 20}) == "temperature 1, top-p off, top-k 20"


def _row(task, method, sample, score, seed=None):
    row = {"dataset": "ruler", "task": task, "method": method, "budget": None if method == "dense" else 256,
           "length": 4096, "sample": sample, "score": float(score), "prediction": "", "reference": ["x"],
           "device_bytes": 1024, "model": "org/tiny", "metric": "string_match_all",
           "cache_config": None if method == "dense" else {"budget": 256}}
    if seed is not None:
        row.update(sampling=SETTINGS, sample_seed=seed)
    return row


# (task, sample, seed) -> (dense, dual); dual lacks (vt, 1, 1), where dense failed: paired by (prompt, seed) vt's
# difference is 0, while prompt means compared unpaired, or rows keyed by prompt alone, would give dual the lead
SAMPLED = {("niah_single_1", 0, 0): (100, 100), ("niah_single_1", 0, 1): (0, 0),
           ("niah_single_1", 1, 0): (100, 0), ("niah_single_1", 1, 1): (100, 0),
           ("niah_single_1", 2, 0): (0, 100), ("niah_single_1", 2, 1): (100, 100),
           ("vt", 0, 0): (100, 100), ("vt", 0, 1): (0, 0), ("vt", 1, 0): (100, 100), ("vt", 1, 1): (0, None)}
ROWS = ([_row(t, "dense", s, d, seed) for (t, s, seed), (d, _) in SAMPLED.items()]
        + [_row(t, "dual", s, v, seed) for (t, s, seed), (_, v) in SAMPLED.items() if v is not None]
        + [_row("niah_single_1", m, s, 100) for m in ("dense", "dual") for s in range(3)])  # greedy rows beside them


def test_the_table_pairs_sampled_rows_by_prompt_and_seed():
    greedy, sampled = ruler_table.build_tables(ROWS)
    assert greedy.sampling is None and greedy.cells["niah_single_1"]["dual@256"].diff == 0.0
    assert sampled.sampling == SETTINGS and sampled.seeds == [0, 1]
    cell = sampled.cells["niah_single_1"]["dual@256"]
    assert cell.n == 6 and cell.score == pytest.approx(50.0)
    assert cell.diff == pytest.approx((0 - 100 + 50) / 3)  # per prompt: mean over its seeds of dual - dense
    assert cell.diff_low <= cell.diff <= cell.diff_high
    vt = sampled.cells["vt"]["dual@256"]
    assert (vt.diff, vt.diff_low, vt.diff_high, vt.n) == (0.0, 0.0, 0.0, 3)  # identical on every (prompt, seed)
    assert vt.score == pytest.approx((50 + 100) / 2)  # its own rows: prompt 1 has seed 0 only
    # prompts are resampled with all their seeds: dense's first cell is the bootstrap of its per-prompt means
    expected = ruler_table._bootstrap([np.array([50.0, 100.0, 50.0])], np.random.default_rng(ruler_table.SEED))
    dense = sampled.cells["niah_single_1"]["dense"]
    assert (dense.low, dense.high) == pytest.approx(expected)
    average = sampled.average["dual@256"]
    assert average.n == 9 and average.diff == pytest.approx(cell.diff / 2)
    text = ruler_table.markdown(ROWS)
    heading = "### org/tiny, RULER 4K, sampled (temperature 0.7, top-p 0.9, top-k off; sample seeds 0–1)"
    assert heading in text and text.index("### org/tiny, RULER 4K\n") < text.index(heading)
    assert "n: (prompt, seed) pairs" in text


def test_report_and_readme_rows_keep_sampled_rows_apart(tmp_path):
    write_report(ROWS, str(tmp_path / "report"))
    summary = (tmp_path / "report" / "summary.md").read_text(encoding="utf-8")
    assert "| dense (sampled: temperature 0.7, top-p 0.9, top-k off) | – |" in summary and "| dense | – |" in summary
    from dual_cache.eval import results_table

    folder = tmp_path / "results" / "eval" / "ruler-table"
    folder.mkdir(parents=True)
    (folder / "tiny-4k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    greedy, sampled = results_table.ruler_averages(str(tmp_path / "results"))
    assert greedy["measure"].startswith("RULER at 4K, org/tiny: average")
    assert sampled["measure"].startswith("RULER at 4K, org/tiny, sampled (temperature 0.7, top-p 0.9, top-k off; "
                                         "sample seeds 0–1): average")
