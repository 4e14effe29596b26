"""Word-needle prompts over a real document, generated offline and deterministically (`dual-decoder demo`'s question;
the evaluation's needle sweep, recall and benchmark prompts).

The haystack is the Python Language Reference as shipped with every CPython (`pydoc_data.topics`), a real
technical document available offline. The needle follows RULER's niah template with a word key and a
7-digit value: "The special magic number for <word> is: <digits>." A base model without a chat template (e.g.
Gemma-3-270M) gets the question as a completion ending "\nAnswer: The special magic number for <word> is:".
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .chat import format_chat

NEEDLE_WORDS = (
    "apple", "harbor", "violet", "canyon", "lantern", "meadow", "falcon", "glacier", "orchid", "quartz",
    "saddle", "thistle", "walnut", "zephyr", "ember", "juniper",
)


def reference_document() -> str:
    """The Python Language Reference topics, concatenated in sorted order (about 300K characters)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name].strip() for name in sorted(topics))


@dataclass
class NeedlePrompt:
    """One prompt: `text` (the user message), the `key` word, the 7-digit `answer`, and its length in tokens."""

    text: str
    key: str
    answer: str
    n_tokens: int


def make_needle_prompt(tokenizer, target_tokens: int, seed: int = 0, depth: float | None = None) -> NeedlePrompt:
    """A chat-formatted word-needle question over `target_tokens` tokens of the reference document.

    Args:
        tokenizer: a transformers tokenizer with a chat template (or none: plain text ending in a completion cue,
            "\nAnswer: The special magic number for <word> is:", is used).
        target_tokens: length of the formatted prompt in tokens (met within a few tokens).
        seed: chooses the key word, the 7-digit value, the needle depth and the document offset.
        depth: needle position as a fraction of the haystack (default: drawn from the seed in [0.1, 0.9]).

    Raises:
        ValueError: if `target_tokens` is too small to hold the question (< 128).
    """
    if target_tokens < 128:
        raise ValueError(f"target_tokens must be at least 128, got {target_tokens}.")
    rng = random.Random(seed)
    key = rng.choice(NEEDLE_WORDS)
    answer = str(rng.randrange(1_000_000, 10_000_000))
    depth = rng.uniform(0.1, 0.9) if depth is None else depth
    needle = f" The special magic number for {key} is: {answer}. "
    question = (
        f"\n\nWhat is the special magic number for {key} mentioned in the text above? "
        f"Answer with the number only."
    )
    if not getattr(tokenizer, "chat_template", None):  # a base model answers a completion, not a question
        question += f"\nAnswer: The special magic number for {key} is:"
    words = reference_document().split(" ")
    start = rng.randrange(0, len(words) // 2)

    def build(n_words: int) -> str:
        hay = words[start : start + n_words]
        cut = int(len(hay) * depth)
        body = " ".join(hay[:cut]) + needle + " ".join(hay[cut:])
        return body + question

    def length(text: str) -> int:
        return len(format_chat(tokenizer, text))

    lo, hi = 1, len(words) - start
    while lo < hi:  # largest haystack whose prompt fits target_tokens
        mid = (lo + hi + 1) // 2
        if length(build(mid)) <= target_tokens:
            lo = mid
        else:
            hi = mid - 1
    text = build(lo)
    return NeedlePrompt(text=text, key=key, answer=answer, n_tokens=length(text))
