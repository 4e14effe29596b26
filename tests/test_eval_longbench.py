"""LongBench loading from the official-schema fixture, prompt templates and middle truncation."""

import os

import pytest

from dual_cache.eval import longbench
from tests.test_eval_support import char_tokenizer

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "longbench")


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def test_loader_reads_the_fixture():
    data = longbench.load_task("hotpotqa", FIXTURE)
    assert len(data) == 2
    assert set(longbench.REQUIRED_FIELDS) <= set(data.column_names)
    assert data[0]["answers"] == ["Harbor City"]
    assert longbench.load_task("trec", FIXTURE)[0]["all_classes"] == ["Distance", "Individual", "Date", "City"]


def test_loader_errors():
    with pytest.raises(ValueError, match="unknown LongBench task"):
        longbench.load_task("nope", FIXTURE)
    with pytest.raises(FileNotFoundError, match="qasper.jsonl"):
        longbench.load_task("qasper", FIXTURE)


def test_prompt_template_and_chat(tok):
    row = longbench.load_task("hotpotqa", FIXTURE)[1]
    ids = longbench.build_prompt(tok, "hotpotqa", row, max_length=4000)
    text = tok.decode(ids)
    assert text.startswith("U: Answer the question based on the given passages.")  # chat template applied
    assert text.endswith(f"Question: {row['input']}\nAnswer:\nA:")
    trec = longbench.load_task("trec", FIXTURE)[0]
    text = tok.decode(longbench.build_prompt(tok, "trec", trec, max_length=4000))
    assert text.startswith("Please determine the type") and not text.startswith("U:")  # no chat for few-shot tasks


def test_middle_truncation_fits_the_window(tok):
    row = longbench.load_task("hotpotqa", FIXTURE)[0]
    full = longbench.PROMPTS["hotpotqa"].format(context=row["context"], input=row["input"])
    assert len(full) > 2000
    ids = longbench.build_prompt(tok, "hotpotqa", row, max_length=600)
    assert len(ids) <= 600 - longbench.MAX_NEW_TOKENS["hotpotqa"]
    text = tok.decode(ids)
    assert "Answer the question based on the given passages" in text[:120]  # head kept
    assert row["input"] in text[-200:]  # tail kept
    assert "founded the Lantern Museum" in text
    with pytest.raises(ValueError, match="no room"):
        longbench.build_prompt(tok, "gov_report", row, max_length=300)


def test_build_samples(tok):
    samples = longbench.build_samples(tok, ["passage_count", "lcc"], 2048, data_dir=FIXTURE)
    assert [s["task"] for s in samples] == ["passage_count", "lcc"]
    assert samples[0]["references"] == ["2"]  # integer answers become strings
    assert samples[0]["max_new_tokens"] == 32 and samples[1]["max_new_tokens"] == 64
    assert samples[0]["length"] == len(samples[0]["input_ids"])
