"""Hugging Face Hub integration: the shipped custom_generate folder, model cards, and their CLI (issue 7).

Everything runs offline on tiny random-weight models.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import huggingface_hub
import pytest
import torch
from huggingface_hub import ModelCard, metadata_load
from huggingface_hub.repocard_data import model_index_to_eval_results
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.generation.streamers import BaseStreamer

import dual_cache
from dual_cache.cli.hub import custom_generate_dir, export_custom_generate
from dual_cache.cli.main import main
from dual_cache.eval.card import hub_card
from tests.conftest import tiny_llama

FIXTURE = Path(__file__).parent / "fixtures" / "eval_results.jsonl"
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
CFG = {"budget": 16, "n_sink": 4, "window": 16}  # 36 resident of 120: retrieval really is sparse
PACKAGE_DIR = str(custom_generate_dir().parent)  # the dual_cache folder itself holds custom_generate/


class Recorder(BaseStreamer):
    """Collects every `put` (prompt first, then each generated token) and whether `end` was called."""

    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.detach().clone().reshape(-1))

    def end(self):
        self.ended = True


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def prompt():
    torch.manual_seed(1)
    ids = torch.randint(3, 96, (1, 120))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


@pytest.fixture(scope="module")
def dual_tokens(model, prompt):
    return model.generate(**prompt, max_new_tokens=10, do_sample=False, cache_implementation="dual",
                          cache_config=CFG)


@pytest.fixture
def repo(tmp_path, model):
    """A model repository folder (save_pretrained) with the custom_generate folder exported into it."""
    model.save_pretrained(tmp_path)
    export_custom_generate(tmp_path)
    return tmp_path


# ---------------------------------------------------------------- custom_generate


def test_shipped_folder_follows_the_convention():
    folder = custom_generate_dir()
    assert (folder / "generate.py").is_file()
    requirements = (folder / "requirements.txt").read_text().split()
    assert any(r.startswith("dual-cache") for r in requirements)
    from transformers.dynamic_module_utils import check_python_requirements

    check_python_requirements(PACKAGE_DIR, requirements_file="custom_generate/requirements.txt")  # all installed


@pytest.mark.parametrize("where", ["package", "exported"])
def test_custom_generate_matches_dual_and_streams_every_token(model, prompt, dual_tokens, repo, where):
    path = PACKAGE_DIR if where == "package" else str(repo)
    streamer = Recorder()
    out = model.generate(**prompt, max_new_tokens=10, do_sample=False, custom_generate=path, trust_remote_code=True,
                         cache_config=CFG, streamer=streamer)
    assert torch.equal(out, dual_tokens)
    dense = model.generate(**prompt, max_new_tokens=10, do_sample=False)
    assert not torch.equal(out, dense)  # the comparison is meaningful: the sparse path changes tokens here
    assert streamer.ended
    assert torch.equal(streamer.chunks[0], prompt["input_ids"][0])
    assert torch.equal(torch.cat(streamer.chunks[1:]), out[0, prompt["input_ids"].shape[1]:])


def test_custom_generate_matches_dual_under_sampling(model, prompt, repo):
    kwargs = dict(max_new_tokens=8, do_sample=True, temperature=0.9, top_k=20, cache_config=CFG)
    torch.manual_seed(7)
    direct = model.generate(**prompt, cache_implementation="dual", **kwargs)
    torch.manual_seed(7)
    custom = model.generate(**prompt, custom_generate=str(repo), trust_remote_code=True, **kwargs)
    assert torch.equal(direct, custom)


def test_repo_loaded_with_trust_remote_code_decodes_dual_without_recursion(prompt, dual_tokens, repo):
    loaded = AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True)
    out = loaded.generate(prompt["input_ids"], attention_mask=prompt["attention_mask"], max_new_tokens=10,
                          do_sample=False, cache_config=CFG, return_dict_in_generate=True)
    assert torch.equal(out.sequences, dual_tokens)
    cache = getattr(out, "cache", None) or out.past_key_values
    assert isinstance(cache, dual_cache.DualDecoderCache)
    # passing custom_generate again on such a model must not recurse either
    again = loaded.generate(**prompt, max_new_tokens=10, do_sample=False, cache_config=CFG,
                            custom_generate=str(repo), trust_remote_code=True)
    assert torch.equal(again, dual_tokens)


def test_reentry_is_refused_instead_of_recursing(prompt, repo):
    loaded = AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True)
    base = type(loaded)
    # a model class whose generate() routes back to the instance attribute (our recipe) would loop forever
    routed = type("Routed", (base,), {"generate": lambda self, *a, **k: self.__dict__["generate"](*a, **k)})
    loaded.__class__ = routed
    with pytest.raises(RuntimeError, match="re-entered"):
        loaded.generate(**prompt, max_new_tokens=2, cache_config=CFG)


def test_custom_generate_errors(model, prompt, repo):
    with pytest.raises(ValueError, match="cache_implementation='static'"):
        model.generate(**prompt, max_new_tokens=2, custom_generate=str(repo), trust_remote_code=True,
                       cache_implementation="static")
    with pytest.raises(ValueError, match="DynamicCache"):
        model.generate(**prompt, max_new_tokens=2, custom_generate=str(repo), trust_remote_code=True,
                       cache=DynamicCache(config=model.config))
    with pytest.raises(ValueError, match="trust_remote_code"):  # transformers gates local folders too
        model.generate(**prompt, max_new_tokens=2, custom_generate=str(repo), trust_remote_code=False)


def test_custom_generate_accepts_config_object_and_cache_object(model, prompt, dual_tokens, repo):
    out = model.generate(**prompt, max_new_tokens=10, do_sample=False, custom_generate=str(repo),
                         trust_remote_code=True, cache_config=dual_cache.DualDecoderConfig(**CFG))
    assert torch.equal(out, dual_tokens)
    cache = dual_cache.DualDecoderCache(model.config, **CFG)
    out = model.generate(**prompt, max_new_tokens=10, do_sample=False, custom_generate=str(repo),
                         trust_remote_code=True, cache=cache)
    assert torch.equal(out, dual_tokens)


# ---------------------------------------------------------------- model card


def _expected_cells():
    """(dataset, task, length, method, budget) -> mean score, computed straight from the fixture."""
    sums = defaultdict(list)
    for line in FIXTURE.read_text().splitlines():
        row = json.loads(line)
        sums[(row["dataset"], row["task"], row["length"], row["method"], row["budget"])].append(row["score"])
    return {key: sum(v) / len(v) for key, v in sums.items()}


def test_card_metadata_validates_offline_and_holds_every_result(tmp_path):
    results = hub_card.aggregate(hub_card.load_results(FIXTURE))
    card = hub_card.render_card(results, MODEL)
    out = tmp_path / "README.md"
    hub_card.write_card_atomic(card, out)

    metadata = metadata_load(out)  # the Hub client's own front-matter reader
    name, evals = model_index_to_eval_results(metadata["model-index"])
    reloaded = ModelCard.load(out)  # ModelCardData(**metadata) parses and checks model-index
    hub_card.validate_card_offline(out.read_text(), expected=reloaded.data.eval_results)
    assert name == MODEL and metadata["pipeline_tag"] == "text-generation" and "dual-cache" in metadata["tags"]

    expected = _expected_cells()
    assert len(evals) == len(expected)
    by_key = {}
    for e in evals:
        assert e.task_type == "text-generation"
        by_key[(e.dataset_config, e.metric_args["method"], e.metric_args.get("budget"))] = e
    table = card.text
    for (dataset, task, length, method, budget), score in expected.items():
        e = by_key[(f"{task}-{length}", method, budget)]
        assert e.metric_value == pytest.approx(round(score, 2))
        assert hub_card.length_label(length) in e.dataset_name
        assert f"| {method} | {'–' if budget is None else budget} |" in table
        assert f"| {score:.2f} |" in table
    ruler = by_key[("niah_single_1-4096", "dual", 256)]
    assert ruler.dataset_name == "RULER NIAH-single-1 4K" and ruler.metric_type == "accuracy"
    assert by_key[("hotpotqa-8192", "dense", None)].metric_type == "qa_f1"  # the row's own metric
    assert by_key[("gov_report-8192", "dual", 128)].metric_type == "rouge"  # LongBench's, when rows name none
    assert by_key[("teacher_forced_top1-4096", "dual", 128)].dataset_name == "Fidelity vs dense teacher_forced_top1 4K"
    assert "custom_generate=" in table and 'cache_implementation="dual"' in table
    assert "| `budget` | per row (see the table) |" in table


def test_card_configuration_comes_from_the_rows_unless_given(tmp_path):
    rows = hub_card.load_results(FIXTURE)
    assert hub_card.cache_config_from_rows(rows) == {"n_sink": 4, "window": 64}  # budgets differ: per row
    out = tmp_path / "README.md"
    assert main(["card", "--results", str(FIXTURE), "--model", MODEL, "--out", str(out)]) == 0
    assert 'cache_config={"n_sink": 4, "window": 64}' in out.read_text()
    assert main(["card", "--results", str(FIXTURE), "--model", MODEL, "--out", str(out),
                 "--cache-config", '{"budget": 512, "speculator": "ngram"}']) == 0
    text = out.read_text()
    assert 'cache_config={"budget": 512, "speculator": "ngram"}' in text and "| `speculator` | `ngram` |" in text


def test_card_updates_an_existing_card_in_place():
    results = hub_card.aggregate(hub_card.load_results(FIXTURE))
    other = huggingface_hub.EvalResult(task_type="text-generation", dataset_type="gsm8k", dataset_name="GSM8K",
                                       metric_type="accuracy", metric_value=31.0)
    existing = ModelCard(
        f"---\n{huggingface_hub.ModelCardData(license='apache-2.0', model_name=MODEL, eval_results=[other], tags=['mine']).to_yaml()}"
        "\n---\n# My model\n\nHand-written text.\n"
    )
    first = hub_card.render_card(results, MODEL, existing=str(existing))
    second = hub_card.render_card(results, MODEL, existing=str(first))
    assert str(first) == str(second)  # idempotent: the marked section is replaced, not appended again
    assert "Hand-written text." in first.text and first.text.count(hub_card.SECTION_BEGIN) == 1
    assert first.data.license == "apache-2.0" and {"mine", "dual-cache"} <= set(first.data.tags)
    assert other in first.data.eval_results and len(first.data.eval_results) == len(results) + 1


def test_offline_validation_rejects_malformed_metadata():
    good = str(hub_card.render_card(hub_card.aggregate(hub_card.load_results(FIXTURE)), MODEL))
    with pytest.raises(ValueError):  # a metric without a value
        hub_card.validate_card_offline(good.replace("      value: 100.0\n", "", 1))
    with pytest.raises(ValueError):  # model-index without results
        hub_card.validate_card_offline("---\nmodel-index:\n- name: x\n---\ntext\n")
    missing = huggingface_hub.EvalResult(task_type="text-generation", dataset_type="ruler", dataset_name="RULER x",
                                         metric_type="accuracy", metric_value=1.0)
    with pytest.raises(ValueError, match="missing"):
        hub_card.validate_card_offline(good, expected=[missing])


def test_summary_files_and_model_filter(tmp_path):
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"rows": [
        {"dataset": "ruler", "task": "vt", "method": "dual", "budget": 64, "length": 2048, "score": 80.0,
         "samples": 3, "model": "a"},
        {"dataset": "ruler", "task": "vt", "method": "dual", "budget": 64, "length": 2048, "score": 40.0,
         "samples": 1, "model": "a"},
        {"dataset": "ruler", "task": "vt", "method": "dense", "budget": None, "length": 2048, "score": 90.0,
         "model": "b"},
    ]}))
    rows = hub_card.load_results(summary)
    with pytest.raises(hub_card.ResultsError, match="several models"):
        hub_card.aggregate(rows)
    (cell,) = hub_card.aggregate(rows, model="a")
    assert cell.score == pytest.approx(70.0) and cell.samples == 4  # weighted by the summary's sample counts


@pytest.mark.parametrize("line, message", [
    ("{not json", ":1: not valid JSON"),
    ('{"dataset": "ruler", "task": "t", "method": "dual", "length": 4096}', "missing key"),
    ('{"dataset": "ruler", "task": "t", "method": "dual", "length": 4096, "score": 101}', "0 to 100"),
    ('{"dataset": "ruler", "task": "t", "method": "dual", "length": "4K", "score": 1}', "'length'"),
    ('[1, 2]', "JSON object"),
])
def test_bad_results_rows_are_named(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(hub_card.ResultsError, match=message):
        hub_card.load_results(path)


# ---------------------------------------------------------------- CLI


def test_cli_card_writes_and_prints(tmp_path, capsys):
    out = tmp_path / "README.md"
    assert main(["card", "--results", str(FIXTURE), "--model", MODEL, "--out", str(out),
                 "--cache-config", '{"budget": 256, "window": 64}', "--license", "apache-2.0"]) == 0
    card = ModelCard.load(out)
    assert card.data.license == "apache-2.0" and '{"budget": 256, "window": 64}' in card.text
    assert len(card.data.eval_results) == len(_expected_cells())
    assert main(["card", "--results", str(FIXTURE), "--model", MODEL]) == 0
    assert "model-index:" in capsys.readouterr().out


@pytest.mark.parametrize("extra, message", [
    (["--results", "missing.jsonl"], "does not exist"),
    (["--cache-config", '{"budget": -1}'], "budget"),
    (["--cache-config", '{"bogus": 1}'], "Unknown dual cache option"),
    (["--cache-config", "[1]"], "JSON object"),
    (["--cache-config", "missing.json"], "no file named 'missing.json' exists"),
    (["--results-model", "nobody"], "no result row has model"),
    (["--out", "no/such/folder/README.md"], "does not exist"),
    (["--push", "not a repo id!"], "not a valid Hub repo id"),
])
def test_cli_card_errors(tmp_path, capsys, monkeypatch, extra, message):
    monkeypatch.chdir(tmp_path)
    args = ["card", "--results", str(FIXTURE), "--model", MODEL]
    assert main(args + extra) == 2
    assert message in capsys.readouterr().err


def test_cli_push_fails_clearly_and_writes_nothing_when_unauthenticated_or_offline(tmp_path, capsys, monkeypatch):
    out = tmp_path / "README.md"
    args = ["card", "--results", str(FIXTURE), "--model", MODEL, "--out", str(out), "--push", "me/model"]
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    assert main(args) == 2
    assert "not logged in" in capsys.readouterr().err and not out.exists()
    monkeypatch.setattr(huggingface_hub, "is_offline_mode", lambda: True)
    assert main(args) == 2
    assert "offline mode" in capsys.readouterr().err and not out.exists()


def test_cli_push_reports_upload_failure(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(hub_card, "check_push_possible", lambda repo: "token")
    monkeypatch.setattr(hub_card, "fetch_existing_card", lambda repo, token: None)
    pushed = {}

    def refuse(card, repo_id, **kwargs):
        pushed["text"] = str(card)
        raise ConnectionError("Hub unreachable")

    monkeypatch.setattr(ModelCard, "push_to_hub", refuse)
    assert main(["card", "--results", str(FIXTURE), "--model", MODEL, "--push", "me/model"]) == 1
    err = capsys.readouterr().err
    assert "nothing was uploaded" in err and "Hub unreachable" in err
    hub_card.validate_card_offline(pushed["text"])  # what would have been pushed was complete and valid


def test_cli_export_generate(tmp_path, capsys):
    repo = tmp_path / "repo"
    repo.mkdir()
    assert main(["export-generate", str(repo)]) == 0
    target = repo / "custom_generate"
    assert (target / "generate.py").read_bytes() == (custom_generate_dir() / "generate.py").read_bytes()
    assert (target / "requirements.txt").is_file()

    (target / "generate.py").write_text("# edited\n")
    assert main(["export-generate", str(repo)]) == 2
    assert "--force" in capsys.readouterr().err
    assert (target / "generate.py").read_text() == "# edited\n"  # untouched without --force
    assert main(["export-generate", str(repo), "--force"]) == 0
    assert (target / "generate.py").read_bytes() == (custom_generate_dir() / "generate.py").read_bytes()
    assert not [p for p in target.iterdir() if p.name.endswith(".tmp")]

    assert main(["export-generate", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "custom_generate").write_text("a file")
    assert main(["export-generate", str(blocked)]) == 2
    assert "not a folder" in capsys.readouterr().err


def test_unreachable_hub_is_not_mistaken_for_a_missing_readme(tmp_path, capsys, monkeypatch):
    from huggingface_hub.errors import LocalEntryNotFoundError

    def unreachable(repo_id, **kwargs):
        raise LocalEntryNotFoundError("cannot reach the Hub")

    monkeypatch.setattr(hub_card, "check_push_possible", lambda repo: "token")
    monkeypatch.setattr(ModelCard, "load", unreachable)
    out = tmp_path / "README.md"
    assert main(["card", "--results", str(FIXTURE), "--model", MODEL, "--push", "me/model", "--out", str(out)]) == 1
    assert "could not reach the Hugging Face Hub" in capsys.readouterr().err
    assert not out.exists()  # nothing written: the remote card is fetched before any write
