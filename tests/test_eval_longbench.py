"""LongBench loading from the official-schema fixture, prompt templates, truncation and BOS as THUDM/LongBench's
pred.py does them."""

import os

import pytest

from dual_cache.eval.quality import longbench
from dual_cache.eval.quality.chat_format import PLAIN, PromptFormat
from tests.test_eval_support import char_tokenizer

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "longbench")
CHAT = PromptFormat("U: ", "\nA:", chat=True)


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def bos_tok():
    """The character tokenizer with a BOS it adds to every encoding (as Llama / Gemma tokenizers do)."""
    from tokenizers import processors

    tok = char_tokenizer()
    tok.add_special_tokens({"bos_token": "<s>"})
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)])
    assert tok("ab")["input_ids"][0] == tok.bos_token_id
    return tok


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
    text = tok.decode(longbench.build_prompt(tok, "hotpotqa", row, max_length=4000, fmt=CHAT))
    assert text == "U: " + longbench.PROMPTS["hotpotqa"].format(**row) + "\nA:"  # build_chat around the template
    trec = longbench.load_task("trec", FIXTURE)[0]
    text = tok.decode(longbench.build_prompt(tok, "trec", trec, max_length=4000, fmt=CHAT))
    assert text == longbench.PROMPTS["trec"].format(**trec)  # no chat wrapper for the few-shot tasks
    assert longbench.build_prompt(tok, "hotpotqa", row, 4000) == tok(longbench.PROMPTS["hotpotqa"].format(**row))["input_ids"]


def test_official_max_lengths():
    # LongBench's model2maxlen.json: llama2-7b-chat-4k 3500, xgen-7b-8k 7500, vicuna-v1.5-7b-16k 15500, 32k models 31500
    assert [longbench.official_max_length(w) for w in (4096, 8192, 16384, 32768)] == [3500, 7500, 15500, 31500]
    with pytest.raises(ValueError, match="too small"):
        longbench.official_max_length(1024)


def test_truncation_keeps_halves_of_the_max_length_with_bos_before_the_wrapper(bos_tok):
    row = longbench.load_task("hotpotqa", FIXTURE)[0]
    full = longbench.PROMPTS["hotpotqa"].format(context=row["context"], input=row["input"])
    assert len(full) > 2000
    ids = longbench.build_prompt(bos_tok, "hotpotqa", row, max_length=600, fmt=CHAT)
    # pred.py: tokenize with BOS (601 ids -> truncate), keep decode(ids[:300]) + decode(ids[-300:]) without special
    # tokens, i.e. the first 299 characters and the last 300, then build_chat, then tokenize with BOS again
    expected = "U: " + full[:299] + full[-300:] + "\nA:"
    assert ids[0] == bos_tok.bos_token_id and bos_tok.decode(ids[1:]) == expected
    assert len(ids) == 1 + len(expected)
    # no-chat tasks get the BOS too (pred.py tokenizes every prompt with special tokens)
    trec = longbench.load_task("trec", FIXTURE)[0]
    assert longbench.build_prompt(bos_tok, "trec", trec, 4000, fmt=CHAT)[0] == bos_tok.bos_token_id
    # a prompt that fits is left alone
    short = longbench.load_task("lcc", FIXTURE)[0]
    assert bos_tok.decode(longbench.build_prompt(bos_tok, "lcc", short, 4000)[1:]) == longbench.PROMPTS["lcc"].format(**short)


def test_samsum_stops_at_newline(tok):
    kwargs = longbench.generate_kwargs(tok, "samsum")
    assert kwargs == {"eos_token_id": [tok.eos_token_id, tok.encode("\n", add_special_tokens=False)[-1]],
                      "min_new_tokens": 1}
    assert longbench.generate_kwargs(tok, "hotpotqa") == {}


def test_build_samples(tok):
    samples = longbench.build_samples(tok, ["passage_count", "lcc"], 2048, data_dir=FIXTURE)
    assert [s["task"] for s in samples] == ["passage_count", "lcc"]
    assert samples[0]["references"] == ["2"]  # integer answers become strings
    assert samples[0]["max_new_tokens"] == 32 and samples[1]["max_new_tokens"] == 64
    assert samples[0]["length"] == len(samples[0]["input_ids"]) and samples[0]["generate_kwargs"] == {}
    assert longbench.build_samples(tok, ["lcc"], 2048, data_dir=FIXTURE, fmt=CHAT)[0]["input_ids"] == \
        samples[1]["input_ids"]  # lcc is a no-chat task
    assert PLAIN.wrap("x") == "x"
