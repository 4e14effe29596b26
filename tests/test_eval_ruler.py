"""RULER generators: deterministic, on target length, answers present; built as `datasets.Dataset`."""

import collections
import re

import datasets
import pytest

from dual_cache.eval import ruler
from tests.test_eval_support import char_tokenizer

# tolerance in tokens below the target: the haystack grows in units (a word, a noise sentence, a needle line, a
# numbered word, ten coded words); a character tokenizer makes units long, so the bounds here are loose-ish
TOLERANCE = {"niah_multikey_2": 80, "niah_multikey_3": 110, "cwe": 40, "fwe": 80}


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.mark.parametrize("task", ruler.TASKS)
def test_deterministic_and_on_target(tok, task):
    a = ruler.generate_sample(tok, task, 3000, seed=3)
    b = ruler.generate_sample(tok, task, 3000, seed=3)
    assert a == b
    c = ruler.generate_sample(tok, task, 3000, seed=4)
    assert c["input"] != a["input"]
    target = 3000 - a["max_new_tokens"]
    assert target - TOLERANCE.get(task, 12) <= a["n_tokens"] <= target
    assert a["n_tokens"] == len(a["input_ids"])
    assert a["input_ids"] == ruler.prompt_ids(tok, a["input"], a["answer_prefix"])


@pytest.mark.parametrize("task", [t for t in ruler.TASKS if t.startswith("niah")])
def test_niah_needles_and_question(tok, task):
    spec = ruler.NIAH_TASKS[task]
    row = ruler.generate_sample(tok, task, 3000, seed=1)
    assert len(row["outputs"]) == spec.num_v * spec.num_q
    for value in row["outputs"]:
        assert row["input"].count(f"is: {value}.") == 1
    keys = re.findall(r"magic \w+ for (\S+) is:", row["input"])
    question = row["input"].rsplit("What are all", 1)[1]
    assert sum(k in question for k in set(keys)) == spec.num_q
    if spec.type_v == "numbers":
        assert all(re.fullmatch(r"\d{7}", v) for v in row["outputs"])


def test_vt_cwe_fwe_answers(tok):
    vt = ruler.generate_sample(tok, "vt", 3000, seed=0)
    value = re.search(r"VAR \w+ = (\d+)\.", vt["input"]).group(1)
    assert f"assigned the value {value}" in vt["input"] and len(vt["outputs"]) == 5
    for name in vt["outputs"]:
        assert f"VAR {name} = " in vt["input"]
    cwe = ruler.generate_sample(tok, "cwe", 3000, seed=0)
    listed = collections.Counter(re.findall(r"^\d+\. (\w+)$", cwe["input"], flags=re.M))
    assert set(cwe["outputs"]) == {w for w, _ in listed.most_common(10)}
    assert min(listed[w] for w in cwe["outputs"]) > max(n for w, n in listed.items() if w not in cwe["outputs"])
    fwe = ruler.generate_sample(tok, "fwe", 3000, seed=0)
    body = fwe["input"].split("coded words. ", 1)[1].split("\nQuestion:")[0]
    counts = collections.Counter(w for w in body.split() if w != "....")
    assert fwe["outputs"] == [w for w, _ in counts.most_common(3)]


def test_build_dataset_and_errors(tok):
    data = ruler.build_dataset(tok, ["niah_single_1", "vt"], [1024], 2, seed=5)
    assert isinstance(data, datasets.Dataset)
    assert len(data) == 4 and data["sample"] == [0, 1, 0, 1]
    assert data[1]["input"] == ruler.generate_sample(tok, "niah_single_1", 1024, 6)["input"]
    with pytest.raises(ValueError, match="unknown RULER task"):
        ruler.build_dataset(tok, ["niah_single_9"], [1024], 1)
    with pytest.raises(ValueError, match="num_samples"):
        ruler.build_dataset(tok, ["vt"], [1024], 0)
    with pytest.raises(ValueError, match="too short"):
        ruler.generate_sample(tok, "niah_single_2", 150, 0)


@pytest.mark.slow
def test_embedded_tokenizer_lengths():
    from transformers import AutoTokenizer

    from dual_cache.models import DEFAULT_GGUF_FILE, default_model_folder

    bpe = AutoTokenizer.from_pretrained(default_model_folder(), gguf_file=DEFAULT_GGUF_FILE)
    for task in ("niah_single_1", "niah_single_2", "niah_multivalue", "vt"):
        row = ruler.generate_sample(bpe, task, 4096, 0)
        assert 4096 - row["max_new_tokens"] - 16 <= row["n_tokens"] <= 4096 - row["max_new_tokens"]


def test_simple_template(tok):
    row = ruler.generate_sample(tok, "niah_single_2", 3000, seed=2, template="simple")
    value = row["outputs"][0]
    assert row["answer_prefix"] == "" and "Some special magic" not in row["input"]
    assert "The special magic number for " in row["input"] and f"is: {value}." in row["input"]
    assert row["input"].endswith("mentioned in the text above? Answer with the number only.")
    multi = ruler.generate_sample(tok, "niah_multivalue", 3000, seed=2, template="simple")
    assert "What are all the special magic numbers for" in multi["input"]
    with pytest.raises(ValueError, match="template"):
        ruler.generate_sample(tok, "vt", 3000, 0, template="fancy")
