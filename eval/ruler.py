"""RULER synthetic tasks, generated offline and deterministically from a seed at a target token length.

Tasks follow RULER (Hsieh et al., 2024, "RULER: What's the Real Context Size of Your Long-Context Language
Models?"; the task definitions, templates and answer prefixes of its `synthetic.yaml` / `constants.py`):

| task | haystack | keys / values | needles |
|---|---|---|---|
| `niah_single_1` | noise (repeated sentences) | words / 7-digit numbers | 1 |
| `niah_single_2` | essay | words / numbers | 1 |
| `niah_single_3` | essay | words / UUIDs | 1 |
| `niah_multikey_1` | essay | words / numbers | 4 keys, 1 queried |
| `niah_multikey_2` | needles (every line a distractor needle) | words / numbers | 1 queried |
| `niah_multikey_3` | needles | UUIDs / UUIDs | 1 queried |
| `niah_multivalue` | essay | words / numbers | 1 key, 4 values |
| `niah_multiquery` | essay | words / numbers | 4 keys, all queried |
| `vt` | noise | variable chain (1 chain, 4 hops) | — |
| `cwe` | numbered word list | 10 common words × 30, the rest × 3 | — |
| `fwe` | coded words, Zipf (alpha 2) frequencies | top 3 | — |

Differences from RULER, all forced by working offline: the essay haystack is the Python Language Reference shipped
with CPython (`pydoc_data.topics`, see `needle.reference_document`) instead of Paul Graham's essays; word keys are
adjective-noun pairs from a fixed list here instead of the `wonderwords` package; `cwe` draws its words from the
same document and has no few-shot example; `fwe` draws Zipf ranks with Python's `random` over a fixed vocabulary.

Prompts are the user turn of the tokenizer's chat template followed by the task's answer prefix (as RULER does for
chat models; `answer_prefix=False` leaves it out), and a prompt of length `L` fills `L - tokens_to_generate` tokens
(RULER's convention, so prompt + answer fits `L`). `template="simple"` rewords NIAH the way `needle.py` does (no
preamble or answer prefix; "What is the special magic number for K mentioned in the text above? Answer with the
number only."): the embedded SmolLM2-135M answers that with dense attention at 4K–8K tokens but not RULER's
wording, so comparisons against dense need it on that model. Scoring is RULER's string match (`all` for every task here), in the local `evaluate` module
`metrics/ruler_string_match.py`.
"""

from __future__ import annotations

import random
import re
import string
import uuid
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

from .needle import format_chat, reference_document

ADJECTIVES = (
    "ancient", "bitter", "brave", "calm", "clever", "crimson", "curious", "daring", "eager", "fancy", "fierce",
    "gentle", "gloomy", "golden", "graceful", "hollow", "humble", "icy", "jolly", "kind", "lively", "lucky", "mellow",
    "misty", "noble", "odd", "polite", "proud", "quiet", "rapid", "rusty", "shiny", "silent", "silver", "sleepy",
    "smooth", "stormy", "sturdy", "swift", "tender", "tidy", "vivid", "wandering", "wild", "witty", "young",
)
NOUNS = (
    "anchor", "badger", "basket", "beacon", "blossom", "bridge", "candle", "castle", "cobbler", "compass", "cradle",
    "dragon", "engine", "feather", "fiddle", "forest", "garden", "harbor", "helmet", "island", "jacket", "kettle",
    "lantern", "ledger", "meadow", "mirror", "monkey", "needle", "orchard", "otter", "pebble", "pepper", "pillow",
    "puzzle", "quilt", "rabbit", "ribbon", "saddle", "tavern", "thimble", "tunnel", "velvet", "violin", "wagon",
    "walnut", "window",
)
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

NIAH_TEMPLATE = (
    "Some special magic {type_v} are hidden within the following text. Make sure to memorize it. I will quiz you "
    "about the {type_v} afterwards.\n{context}\nWhat are all the special magic {type_v} for {query} mentioned in "
    "the provided text?"
)
NIAH_ANSWER_PREFIX = " The special magic {type_v} for {query} mentioned in the provided text are"
NIAH_NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
# "simple" template (eval/needle.py's wording, which the embedded 135M model answers with dense attention)
SIMPLE_NEEDLE = "The special magic {type_1} for {key} is: {value}."
SIMPLE_QUESTION = "\n\nWhat is the special magic {type_1} for {query} mentioned in the text above? Answer with the {type_1} only."
SIMPLE_QUESTION_MULTI = (
    "\n\nWhat are all the special magic {type_v} for {query} mentioned in the text above? Answer with the {type_v} only."
)
TEMPLATES = ("ruler", "simple")
VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
VT_ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assigned "
    "the value {query}, they are: "
)
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that "
    "appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?"
)
CWE_ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
    "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
FWE_ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"


@dataclass(frozen=True)
class NiahSpec:
    """One NIAH variant: haystack kind (`noise`, `essay`, `needle`), key/value kinds (`words`, `numbers`,
    `uuids`), and the number of keys inserted, values per key and keys queried."""

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
#: tokens RULER reserves for the answer of each task family (prompt length = target length - this)
TOKENS_TO_GENERATE = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50}
TASKS = (*NIAH_TASKS, "vt", "cwe", "fwe")


def task_family(task: str) -> str:
    """`"niah"`, `"vt"`, `"cwe"` or `"fwe"`. Raises `ValueError` for an unknown task (listing the valid ones)."""
    if task in NIAH_TASKS:
        return "niah"
    if task in ("vt", "cwe", "fwe"):
        return task
    raise ValueError(f"unknown RULER task {task!r}; valid tasks: {list(TASKS)}.")


# --- content pieces -----------------------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def essay_sentences() -> tuple[str, ...]:
    """Sentences of the offline essay haystack (`needle.reference_document`, split after `.`, `!`, `?`)."""
    return tuple(s for s in re.split(r"(?<=[.!?])\s+", reference_document()) if s.strip())


@lru_cache(maxsize=1)
def essay_words() -> tuple[str, ...]:
    """Distinct lowercase words of 4–10 letters of the essay document, sorted (about 2,300)."""
    return tuple(sorted(set(re.findall(r"\b[a-z]{4,10}\b", reference_document()))))


def noise_units(n: int) -> list[str]:
    """The first `n` sentences of the repeated noise haystack (one sentence per unit)."""
    sentences = re.split(r"(?<=\.) ", NOISE)
    return [sentences[i % len(sentences)] for i in range(n)]


@lru_cache(maxsize=1)
def essay_word_stream() -> tuple[str, ...]:
    """The essay document as space-separated words (newlines kept inside words)."""
    return tuple(w for w in reference_document().split(" ") if w)


def _insert_at_sentence_end(words: list[str], needles: list[str], depths: list[float]) -> list[str]:
    """Insert needles after the first sentence-ending word at or after each depth (else at the depth)."""
    positions = []
    for depth in depths:
        pos = round(depth * len(words))
        end = next((i + 1 for i in range(pos, min(len(words), pos + 200)) if words[i].endswith((".", "!", "?"))), pos)
        positions.append(end)
    out = list(words)
    for needle, pos in sorted(zip(needles, positions), key=lambda p: p[1], reverse=True):
        out.insert(pos, needle)
    return out


def _word_key(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def _make(kind: str, rng: random.Random) -> str:
    if kind == "words":
        return _word_key(rng)
    if kind == "numbers":
        return str(rng.randrange(1_000_000, 10_000_000))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown key/value kind {kind!r}; use 'words', 'numbers' or 'uuids'.")


def _distinct(kind: str, rng: random.Random, n: int, exclude: set[str] = frozenset()) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        item = _make(kind, rng)
        if item not in out and item not in exclude:
            out.append(item)
    return out


# --- prompt assembly and length fitting ---------------------------------------------------------------------------
def prompt_ids(tokenizer, text: str, answer_prefix: str) -> list[int]:
    """Token ids of `text` as a chat user turn (see `needle.format_chat`) followed by the answer prefix."""
    ids = format_chat(tokenizer, text)
    prefix = answer_prefix.lstrip() if getattr(tokenizer, "chat_template", None) else answer_prefix
    return ids + tokenizer(prefix, add_special_tokens=False)["input_ids"]


def _fit(tokenizer, build: Callable[[int], tuple[str, str]], target: int, upper: int) -> tuple[int, list[int]]:
    """Largest `n` in [1, upper] whose prompt `build(n) -> (text, answer_prefix)` fits `target` tokens.

    Raises:
        ValueError: when even `n = 1` does not fit.
    """
    def ids_of(n: int) -> list[int]:
        return prompt_ids(tokenizer, *build(n))

    if len(ids_of(1)) > target:
        raise ValueError(f"target length {target} tokens is too short for this task's template and needles.")
    upper = min(upper, target)  # every unit holds at least one token
    lo, hi = 1, 2
    while hi < upper and len(ids_of(hi)) <= target:  # gallop to bracket the answer cheaply
        lo, hi = hi, hi * 2
    hi = min(hi, upper)
    while lo < hi:  # ids_of(n) grows monotonically with n
        mid = (lo + hi + 1) // 2
        if len(ids_of(mid)) <= target:
            lo = mid
        else:
            hi = mid - 1
    return lo, ids_of(lo)


def _insert(units: list[str], needles: list[str], depths: list[float]) -> list[str]:
    """Insert `needles` between `units` at relative `depths` in [0, 1] (stable for equal depths)."""
    out = list(units)
    for needle, depth in sorted(zip(needles, depths), key=lambda p: p[1], reverse=True):
        out.insert(round(depth * len(units)), needle)
    return out


def _niah(tokenizer, spec: NiahSpec, target: int, rng: random.Random, use_prefix: bool = True,
          simple: bool = False) -> dict:
    type_1 = spec.type_v[:-1]  # "numbers" -> "number", "uuids" -> "uuid"
    single = spec.num_v * spec.num_q == 1
    needle_format = SIMPLE_NEEDLE if simple and single else NIAH_NEEDLE
    keys = _distinct(spec.type_k, rng, spec.num_k)
    values = [_distinct(spec.type_v, rng, spec.num_v) for _ in keys]
    needles = [needle_format.format(type_v=spec.type_v, type_1=type_1, key=k, value=v)
               for k, vs in zip(keys, values) for v in vs]
    depths = [rng.uniform(0.05, 0.95) for _ in needles]
    queried = rng.sample(range(len(keys)), spec.num_q)
    query_keys = [keys[i] for i in queried]
    answers = [v for i in queried for v in values[i]]
    query = query_keys[0] if len(query_keys) == 1 else ", ".join(query_keys[:-1]) + f", and {query_keys[-1]}"
    type_v = spec.type_v
    sep = " "
    if spec.haystack == "noise":
        pool = noise_units(target)
    elif spec.haystack == "essay":
        words = essay_word_stream()
        start = rng.randrange(len(words))
        pool = [words[(start + i) % len(words)] for i in range(min(target, len(words)))]
    elif spec.haystack == "needle":
        pool = []
        while len(pool) < target // 8 + 8:  # distractor needles (keys may repeat, never a real key)
            key = _make(spec.type_k, rng)
            if key not in keys:
                pool.append(needle_format.format(type_v=spec.type_v, type_1=type_1, key=key,
                                                 value=_make(spec.type_v, rng)))
        sep = "\n"
    else:
        raise ValueError(f"unknown haystack {spec.haystack!r}")
    prefix = NIAH_ANSWER_PREFIX.format(type_v=type_v, query=query) if use_prefix and not simple else ""

    def build(n: int) -> tuple[str, str]:
        units = pool[:n]
        if spec.haystack == "essay":  # needles go at the next sentence end after their depth
            context = sep.join(_insert_at_sentence_end(units, needles, depths))
        else:
            context = sep.join(_insert(units, needles, depths))
        if simple:
            question = (SIMPLE_QUESTION if single else SIMPLE_QUESTION_MULTI).format(
                type_1=type_1, type_v=type_v, query=query)
            return context + question, prefix
        return NIAH_TEMPLATE.format(type_v=type_v, context=context, query=query), prefix

    n, ids = _fit(tokenizer, build, target, len(pool))
    text, _ = build(n)
    return {"input": text, "answer_prefix": prefix, "outputs": answers, "input_ids": ids}


def _vt(tokenizer, target: int, rng: random.Random, use_prefix: bool = True, num_hops: int = 4) -> dict:
    names: list[str] = []  # a list, not a set: set order of strings changes between processes
    while len(names) < num_hops + 1:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in names:
            names.append(name)
    value = str(rng.randrange(10_000, 100_000))
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i + 1]} = VAR {names[i]}." for i in range(num_hops)]
    depths = sorted(rng.uniform(0.05, 0.95) for _ in chain)
    prefix = VT_ANSWER_PREFIX.format(num_v=len(names), query=value) if use_prefix else ""

    def build(n: int) -> tuple[str, str]:
        context = " ".join(_insert(noise_units(n), chain, depths))
        return VT_TEMPLATE.format(context=context, query=value), prefix

    n, ids = _fit(tokenizer, build, target, target)
    return {"input": build(n)[0], "answer_prefix": prefix, "outputs": list(names), "input_ids": ids}


def _cwe(tokenizer, target: int, rng: random.Random, use_prefix: bool = True, num_cw: int = 10, freq_cw: int = 30,
         freq_ucw: int = 3) -> dict:
    prefix = CWE_ANSWER_PREFIX if use_prefix else ""
    words = list(essay_words())
    rng.shuffle(words)
    common, uncommon = words[:num_cw], words[num_cw:]
    order_rng_seed = rng.getrandbits(32)

    def build(n: int, freq: int) -> tuple[str, str]:
        listed = common * freq + uncommon[:n] * freq_ucw
        random.Random(order_rng_seed).shuffle(listed)
        context = "\n".join(f"{i + 1}. {w}" for i, w in enumerate(listed))
        return CWE_TEMPLATE.format(context=context), prefix

    freq = freq_cw
    while freq > 2 and len(prompt_ids(tokenizer, *build(1, freq))) > target:
        freq -= 1  # short lengths cannot hold 10 words x 30; RULER likewise lowers the frequency there
    n, ids = _fit(tokenizer, lambda k: build(k, freq), target, len(uncommon))
    return {"input": build(n, freq)[0], "answer_prefix": prefix, "outputs": common, "input_ids": ids}


def _fwe(tokenizer, target: int, rng: random.Random, use_prefix: bool = True, alpha: float = 2.0,
         vocab_size: int = 1000) -> dict:
    prefix = FWE_ANSWER_PREFIX if use_prefix else ""
    vocab: list[str] = []
    while len(vocab) < vocab_size:
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(6))
        if word not in vocab:
            vocab.append(word)
    weights = [1.0 / (rank ** alpha) for rank in range(1, vocab_size + 1)]
    stream = rng.choices(vocab, weights=weights, k=60_000)

    def build(n: int) -> tuple[str, str]:  # n groups of 10 coded words, separated by dots
        context = " .... ".join(" ".join(stream[i * 10 : i * 10 + 10]) for i in range(n))
        return FWE_TEMPLATE.format(context=context), prefix

    n, ids = _fit(tokenizer, build, target, len(stream) // 10)
    counts: dict[str, int] = {}
    for word in stream[: n * 10]:
        counts[word] = counts.get(word, 0) + 1
    top = sorted(counts, key=lambda w: (-counts[w], vocab.index(w)))[:3]
    return {"input": build(n)[0], "answer_prefix": prefix, "outputs": top, "input_ids": ids}


def generate_sample(tokenizer, task: str, length: int, seed: int, answer_prefix: bool = True,
                    template: str = "ruler") -> dict:
    """One RULER sample.

    Args:
        tokenizer: a transformers tokenizer (its chat template, if any, formats the prompt).
        task: one of `TASKS`.
        length: target total length in tokens; the prompt fills `length - TOKENS_TO_GENERATE[family]`.
        seed: sample seed; the same (tokenizer, task, length, seed) always gives the same sample.
        answer_prefix: append RULER's answer prefix after the chat turn (False: the model answers freely; small
            models such as the embedded SmolLM2-135M follow a bare question better than a plural answer prefix).
        template: NIAH wording. `"ruler"`: RULER's template. `"simple"`: no preamble or answer prefix, the needle
            "The special magic number for K is: V." and the question "What is the special magic number for K
            mentioned in the text above? Answer with the number only." (`needle.py`'s wording): the embedded
            135M model answers it with dense attention at 4K-8K, but not RULER's wording.

    Returns:
        dict with `task`, `length` (target), `seed`, `input` (user text), `answer_prefix`, `outputs` (references),
        `input_ids` (prompt token ids), `n_tokens` (their count), `max_new_tokens` and `metric` (`"all"`).

    Raises:
        ValueError: unknown task, or a length too short for the template.
    """
    family = task_family(task)
    if template not in TEMPLATES:
        raise ValueError(f"template must be one of {TEMPLATES}, got {template!r}.")
    budget = length - TOKENS_TO_GENERATE[family]
    if budget < 64:
        raise ValueError(f"length {length} is too short for {task}: need more than {TOKENS_TO_GENERATE[family] + 64}.")
    rng = random.Random(f"ruler/{task}/{length}/{seed}")
    if family == "niah":
        row = _niah(tokenizer, NIAH_TASKS[task], budget, rng, answer_prefix, template == "simple")
    elif family == "vt":
        row = _vt(tokenizer, budget, rng, answer_prefix)
    elif family == "cwe":
        row = _cwe(tokenizer, budget, rng, answer_prefix)
    else:
        row = _fwe(tokenizer, budget, rng, answer_prefix)
    return {
        "task": task, "length": length, "seed": seed, **row, "n_tokens": len(row["input_ids"]),
        "max_new_tokens": TOKENS_TO_GENERATE[family], "metric": "all",
    }


def build_dataset(tokenizer, tasks: list[str], lengths: list[int], num_samples: int, seed: int = 0,
                  answer_prefix: bool = True, template: str = "ruler"):
    """A `datasets.Dataset` of RULER samples: every task × length × `num_samples` (seeds `seed`, `seed + 1`, ...).

    Columns as `generate_sample` returns, plus `sample` (index within its task and length).

    Raises:
        ValueError: unknown task, non-positive length or sample count (checked before any generation).
    """
    import datasets

    for task in tasks:
        task_family(task)
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}.")
    for length in lengths:
        if length < 1:
            raise ValueError(f"lengths must be positive token counts, got {length}.")
    rows = []
    for task in tasks:
        for length in lengths:
            for i in range(num_samples):
                rows.append({"sample": i, **generate_sample(tokenizer, task, length, seed + i, answer_prefix, template)})
    return datasets.Dataset.from_list(rows)
