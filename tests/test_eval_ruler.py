"""RULER generators: every task's prompt is the official template (NVIDIA/RULER constants.py, written out here
character for character) with its values substituted; haystacks, depths and generators as RULER builds them;
deterministic; on target length."""

import collections
import json
import re
import string

import datasets
import pytest

from dual_cache.eval.quality import ruler
from dual_cache.eval.quality.chat_format import PLAIN, PromptFormat
from tests.test_eval_support import char_tokenizer

# The official (template, answer prefix) pairs of RULER's scripts/data/synthetic/constants.py, written out here.
OFFICIAL = {
    "niah": ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I "
             "will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
             "{type_needle_v} for {query} mentioned in the provided text?",
             " The special magic {type_needle_v} for {query} mentioned in the provided text are"),
    # niah.py's singular rewrite when num_q * num_v == 1 ("Some"->"A", "are all"->"is", "are"->"is", numbers->number)
    "niah_singular": ("A special magic {type_needle_v} is hidden within the following text. Make sure to memorize "
                      "it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat is the special "
                      "magic {type_needle_v} for {query} mentioned in the provided text?",
                      " The special magic {type_needle_v} for {query} mentioned in the provided text is"),
    "vt": ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
           "Question: Find all variables that are assigned the value {query} in the text above.",
           " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
           "assigned the value {query}, they are: "),
    "cwe": ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
            "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?",
            " Answer: The top 10 words that appear most often in the list are:"),
    "fwe": ("Read the following coded text and track the frequency of each coded word. Find the three most "
            "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the "
            "dots '....'. What are the three most frequently appeared words in the above coded text?",
            " Answer: According to the coded text above, the three most frequently appeared words are:"),
    "qa": ("Answer the question based on the given documents. Only give me the answer and do not output any other "
           "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
           "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}",
           " Answer:"),
}
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
FMT = PromptFormat("<user>", "</user>\n", chat=True)  # a model wrapper, like RULER's model templates


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def template_regex(template: str, rename: str = "") -> str:
    """A regex of `template`: str.format fields become named groups (prefixed with `rename`); a repeated field must
    repeat its text."""
    out, seen = "", set()
    for literal, field, _, _ in string.Formatter().parse(template):
        out += re.escape(literal)
        if field is not None:
            out += f"(?P={rename}{field})" if field in seen else f"(?P<{rename}{field}>.*?)"
            seen.add(field)
    return out


def wrapped(key: str, fmt: PromptFormat) -> str:
    """RULER's prompt: `model_template.format(task_template=template) + answer_prefix`, our wrapper standing for
    the model template."""
    template, answer_prefix = OFFICIAL[key]
    return fmt.prefix.replace("{", "{{") + template + fmt.suffix.replace("{", "{{") + answer_prefix


def parse(key: str, text: str, fmt: PromptFormat = PLAIN) -> dict:
    """The values substituted into the official prompt `key` (wrapped with `fmt`) that give `text`; fails when
    `text` is not that prompt."""
    match = re.fullmatch(template_regex(wrapped(key, fmt)), text, flags=re.S)
    assert match, f"not the official template:\n{text[:400]}...{text[-300:]}"
    return match.groupdict()


def full_prompt(row):
    return row["input"] + row["answer_prefix"]


def test_module_templates_are_the_official_ones():
    for family in ("niah", "vt", "cwe", "fwe", "qa"):
        assert ruler.TEMPLATES[family] == OFFICIAL[family]
    for task, spec in ruler.NIAH_TASKS.items():
        singular = spec.num_q * spec.num_v == 1
        assert task.startswith(("niah_single", "niah_multikey")) == singular
        template, prefix, type_v = ruler.niah_wording(spec)
        assert (template, prefix) == OFFICIAL["niah_singular" if singular else "niah"]
        assert type_v == (spec.type_v[:-1] if singular else spec.type_v)


def test_depth_grid_is_numpys():
    np = pytest.importorskip("numpy")
    assert list(ruler.DEPTHS) == [int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int)]


def needle_regex(type_v: str) -> str:
    return rf"One of the special magic {type_v} for (\S+) is: (\S+)\."


@pytest.mark.parametrize("task", list(ruler.NIAH_TASKS))
@pytest.mark.parametrize("fmt", [PLAIN, FMT], ids=["plain", "wrapped"])
def test_niah_prompt_is_the_official_template(tok, task, fmt):
    spec = ruler.NIAH_TASKS[task]
    row = ruler.generate_sample(tok, task, 4000, seed=1, fmt=fmt)
    singular = spec.num_q * spec.num_v == 1
    values = parse("niah_singular" if singular else "niah", full_prompt(row), fmt)
    assert values["type_needle_v"] == (spec.type_v[:-1] if singular else spec.type_v)
    assert row["answer_prefix"].startswith(" The special magic ")  # the split RULER makes (rfind of its start)
    context = values["context"]
    needles = re.findall(needle_regex(spec.type_v), context)
    keys = {k for k, _ in needles}
    queried = values["query"].replace(", and ", ", ").split(", ")
    assert len(queried) == spec.num_q and set(queried) <= keys
    real = [(k, v) for k, v in needles if k in queried]
    assert sorted(v for _, v in real) == sorted(row["outputs"]) and len(row["outputs"]) == spec.num_v * spec.num_q
    if spec.type_v == "numbers":
        assert all(re.fullmatch(r"\d{7}", v) for v in row["outputs"])
    if spec.haystack == "noise":  # the whole paragraph repeated, one per line; needles on their own lines
        lines = context.split("\n")
        assert set(lines) - {NOISE} == {f"One of the special magic numbers for {k} is: {v}." for k, v in needles}
        assert lines.count(NOISE) == row["haystack_units"] and len(needles) == 1
    elif spec.haystack == "needle":  # every line is a needle
        lines = context.split("\n")
        assert all(re.fullmatch(needle_regex(spec.type_v), line) for line in lines)
        assert len(lines) == row["haystack_units"] + 1
    else:  # essay: sentences and needles joined by spaces, needles at grid depths
        assert len(needles) == max(spec.num_k, spec.num_q) * spec.num_v
        check_essay_context(context, row["haystack_units"], len(needles))


def check_essay_context(context: str, n_words: int, n_needles: int) -> None:
    """`context` is RULER's essay haystack: the first `n_words` essay words split into sentences, the needles put
    between sentences at `int(sentences * depth / 100)` for grid depths, everything joined by single spaces."""
    sents = ruler.sentences(" ".join(ruler.essay_words()[:n_words]).strip())
    segments = re.split(r" ?One of the special magic \w+ for \S+ is: \S+\. ?", context)
    assert len(segments) == n_needles + 1
    cuts, done = [], 0
    for segment in segments[:-1]:
        k = next(k for k in range(len(sents) - done + 1) if " ".join(sents[done:done + k]) == segment)
        done += k
        cuts.append(done)
    assert " ".join(sents[done:]) == segments[-1]
    grid = {int(len(sents) * d / 100) for d in ruler.DEPTHS}
    assert set(cuts) <= grid and cuts == sorted(cuts)


def test_essay_depths_cover_the_grid(tok):
    seen = set()
    for seed in range(12):
        row = ruler.generate_sample(tok, "niah_single_2", 4000, seed=seed)
        context = row["input"].split("afterwards.\n", 1)[1].rsplit("\nWhat is", 1)[0]
        check_essay_context(context, row["haystack_units"], 1)
        seen.add(context.find("One of the special") * 10 // len(context))
    assert len(seen) >= 4  # depths spread over the document, not only the middle


def test_vt_prompt_example_and_chain(tok):
    row = ruler.generate_sample(tok, "vt", 6000, seed=2, fmt=FMT)
    # RULER inserts the one-shot example (task template + answer prefix, no wrapper, + its answer + "\n") and a
    # newline between the model template's prefix and the task text
    example = template_regex("".join(OFFICIAL["vt"]), "x_") + r" (?P<names>[A-Z]{3}(?: [A-Z]{3}){4})\n\n"
    task = template_regex(wrapped("vt", FMT)[len(FMT.prefix):])
    match = re.fullmatch(re.escape(FMT.prefix) + example + task, full_prompt(row), flags=re.S)
    assert match, full_prompt(row)[:600]
    assert match["x_num_v"] == match["num_v"] == "5" and re.fullmatch(r"\d{5}", match["x_query"])
    assert re.fullmatch(r"\d{5}", match["query"]) and row["answer_prefix"].startswith(" Answer: According")
    for context, value, names, k in ((match["x_context"], match["x_query"], match["names"].split(), 3),
                                     (match["context"], match["query"], row["outputs"], 5)):
        lines = context.split("\n")
        chain = [line for line in lines if line != NOISE]
        assert len(chain) == 5 and len(lines) > 5
        assert chain[0] == f"VAR {names[0]} = {value}"
        assert chain[1:] == [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(4)]  # RULER's trailing space
        assert all(len(n) == k for n in names)


@pytest.mark.parametrize("length", [3000, 9000])
def test_cwe_prompt_example_and_counts(tok, length):
    row = ruler.generate_sample(tok, "cwe", length, seed=0, fmt=FMT)
    short = length < 4096  # RULER: below 4K the example has 20 words (x3 / x1), the list x6 / x1; else 40 (x10 / x3), x30 / x3
    example_freqs, freqs = ((3, 1), (6, 1)) if short else ((10, 3), (30, 3))
    # RULER's few-shot: the whole wrapped prompt with the example list, " " + its numbered answer, "\n", the prompt
    regex = template_regex(wrapped("cwe", FMT), "x_") + r" (?P<answer>\d+\. .*?)\n" + template_regex(wrapped("cwe", FMT))
    match = re.fullmatch(regex, full_prompt(row), flags=re.S)
    assert match, full_prompt(row)[:500]
    for context, answer, (high, low), n_words in ((match["x_context"], match["answer"], example_freqs, 20 if short else 40),
                                                  (match["context"], " ".join(row["outputs"]), freqs, None)):
        listed = re.findall(r"(\d+)\. (\S+)", context)
        assert " ".join(f"{i}. {w}" for i, w in listed) == context  # "1. w 2. w ...": joined by spaces
        assert [int(i) for i, _ in listed] == list(range(1, len(listed) + 1))
        counts = collections.Counter(w for _, w in listed)
        common = {w for w, c in counts.items() if c == high}
        assert len(common) == 10 and set(counts.values()) == {high, low}
        assert set(re.findall(r"(?:^|\s)(?:\d+\. )?([^\s\d][^\s]*)", answer)) == common
        if n_words:
            assert len(counts) == n_words
    assert len(row["outputs"]) == 10


def test_fwe_prompt_and_zipf_counts(tok):
    row = ruler.generate_sample(tok, "fwe", 4000, seed=3, fmt=FMT)
    values = parse("fwe", full_prompt(row), FMT)
    counts = collections.Counter(values["context"].split(" "))
    n = row["haystack_units"]
    ranked = [w for w, _ in counts.most_common()]
    assert ranked[0] == "..." and row["outputs"] == ranked[1:4]
    # RULER's counts: int(n * k^-2 / zeta(2)) for the word of rank k
    expected = [c for c in (int(n * k ** -2.0 / (3.141592653589793 ** 2 / 6)) for k in range(1, 1000)) if c > 0]
    assert sorted(counts.values(), reverse=True) == expected[: len(counts)]
    assert all(len(w) == 6 and w.isalpha() for w in ranked[1:])


@pytest.fixture(scope="module")
def qa_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qa")
    squad = {"data": [{"paragraphs": [
        {"context": f"Paragraph {a}-{p} about topic {a}.", "qas": [
            {"question": f"What is {a}-{p}?", "answers": [{"text": f"answer {a}-{p}"}], "is_impossible": False},
            {"question": "Unanswerable?", "answers": [], "is_impossible": True}]}
        for p in range(3)]} for a in range(40)]}
    hotpot = [{"question": f"Who is {i}?", "answer": f"person {i}",
               "context": [[f"Title {i}-{j}", [f"Sentence one of {i}-{j}. ", "Two."]] for j in range(10)]}
              for i in range(30)]
    (folder / "squad.json").write_text(json.dumps(squad))
    (folder / "hotpotqa.json").write_text(json.dumps(hotpot))
    return str(folder)


@pytest.mark.parametrize("task", ["qa_1", "qa_2"])
def test_qa_prompt_documents_and_metric(tok, qa_dir, task):
    row = ruler.generate_sample(tok, task, 3000, seed=4, fmt=FMT, qa_dir=qa_dir)
    values = parse("qa", full_prompt(row), FMT)
    assert row["metric"] == "part" and row["max_new_tokens"] == 32 and row["answer_prefix"] == " Answer:"
    documents = values["context"].split("\n\n")
    for i, doc in enumerate(documents):
        assert doc.startswith(f"Document {i + 1}:\n")
    if task == "qa_1":  # answerable questions in file order (3 per article): sample 4 is article 1, paragraph 1
        assert values["query"] == "What is 1-1?" and row["outputs"] == ["answer 1-1"]
        assert "Paragraph 1-1 about topic 1." in values["context"]
        assert sum("about topic 1." in d for d in documents) == 3  # then the article's other paragraphs
    else:
        assert values["query"] == "Who is 4?" and row["outputs"] == ["person 4"]
        assert sum(f"Title 4-{j}\nSentence one of 4-{j}. Two." in values["context"] for j in range(10)) == 10


def test_qa_without_data_says_what_to_pass(tok, tmp_path):
    with pytest.raises(ValueError, match="qa_dir"):
        ruler.generate_sample(tok, "qa_1", 3000, 0)
    with pytest.raises(FileNotFoundError, match="SQuAD v2.0 dev"):
        ruler.generate_sample(tok, "qa_1", 3000, 0, qa_dir=str(tmp_path))
    with pytest.raises(ValueError, match="qa_dir"):
        ruler.build_dataset(tok, ["qa_2"], [3000], 1)


@pytest.mark.parametrize("task", [t for t in ruler.TASKS if not t.startswith("qa")])
def test_deterministic_and_on_target(tok, task):
    a = ruler.generate_sample(tok, task, 4000, seed=3)
    assert a == ruler.generate_sample(tok, task, 4000, seed=3)
    assert ruler.generate_sample(tok, task, 4000, seed=4)["input"] != a["input"]
    budget = 4000 - a["max_new_tokens"]
    assert a["n_tokens"] == len(a["input_ids"]) <= budget
    assert a["input_ids"] == tok(a["input"] + a["answer_prefix"])["input_ids"]
    grown = {"fwe": 4000 // 32 * 3, "niah_multikey_3": 200, "cwe": 40}.get(task, 100)  # one haystack step
    assert a["n_tokens"] > budget - grown


def test_build_dataset_and_errors(tok):
    data = ruler.build_dataset(tok, ["niah_single_1", "vt"], [2048], 2, seed=5)
    assert isinstance(data, datasets.Dataset)
    assert len(data) == 4 and data["sample"] == [0, 1, 0, 1]
    assert data[1]["input"] == ruler.generate_sample(tok, "niah_single_1", 2048, 6)["input"]
    with pytest.raises(ValueError, match="unknown RULER task"):
        ruler.build_dataset(tok, ["niah_single_9"], [1024], 1)
    with pytest.raises(ValueError, match="num_samples"):
        ruler.build_dataset(tok, ["vt"], [1024], 0)
    with pytest.raises(ValueError, match="too short"):
        ruler.generate_sample(tok, "niah_single_2", 150, 0)


def test_simple_template(tok):
    row = ruler.generate_sample(tok, "niah_single_2", 3000, seed=2, template="simple")
    value = row["outputs"][0]
    assert row["answer_prefix"] == "" and "special magic number is hidden" not in row["input"]
    assert "The special magic number for " in row["input"] and f"is: {value}." in row["input"]
    assert row["input"].endswith("mentioned in the text above? Answer with the number only.")
    multi = ruler.generate_sample(tok, "niah_multivalue", 3000, seed=2, template="simple")
    assert "What are all the special magic numbers for" in multi["input"]
    with pytest.raises(ValueError, match="template"):
        ruler.generate_sample(tok, "vt", 3000, 0, template="fancy")


@pytest.mark.slow
def test_embedded_tokenizer_lengths():
    from transformers import AutoTokenizer

    from dual_cache.eval.quality.chat_format import prompt_format
    from dual_cache.model.loading import DEFAULT_GGUF_FILE, default_model_folder

    bpe = AutoTokenizer.from_pretrained(default_model_folder(), gguf_file=DEFAULT_GGUF_FILE)
    fmt = prompt_format(bpe)
    for task in ("niah_single_1", "niah_single_2", "niah_multivalue", "vt", "cwe", "fwe"):
        row = ruler.generate_sample(bpe, task, 4096, 0, fmt=fmt)
        assert 4096 - row["max_new_tokens"] - 160 <= row["n_tokens"] <= 4096 - row["max_new_tokens"]
