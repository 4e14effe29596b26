"""Prompt lookup kept incrementally for one sequence (`NgramIndex`): the speculators ask it every step, so it pays
per step only for the tokens added since the last question.

Same question as transformers' `PromptLookupCandidateGenerator` asked for one token (longest n-gram first, from
`ngram_size` down to 1; the suffix n-gram's continuation earlier in the sequence), with one deliberate difference:
where the suffix n-gram occurred several times, transformers takes the first (leftmost) occurrence and this index the
most recent one (the text nearest the cursor; transformers' own source marks the leftmost choice as a to-do).
Where the n-gram occurred once, both give the same token (`tests/test_speculators.py` checks both).
"""

from __future__ import annotations

from typing import Sequence

import torch


class NgramIndex:
    """Every n-gram (n = 1..`ngram_size`) of one token sequence, mapped to where its most recent continuation is.

    Args:
        ngram_size: the longest n-gram matched (tokens, ≥ 1).

    Raises:
        ValueError: `ngram_size` < 1.
    """

    TAIL = 8  # tokens compared to tell that a sequence still extends the one indexed (`extends`)

    def __init__(self, ngram_size: int) -> None:
        if ngram_size < 1:
            raise ValueError(f"ngram_size must be at least 1, got {ngram_size}.")
        self.ngram_size = ngram_size
        self.tokens: list[int] = []
        self.next_at: dict[tuple[int, ...], int] = {}  # n-gram -> position of the token after its latest occurrence

    def extends(self, sequence: torch.Tensor | Sequence[int]) -> bool:
        """Whether `sequence` (`(T,)` int64 ids) is at least as long as the indexed tokens and ends them the same way
        (its last `TAIL` indexed positions equal): a cheap check that it is the same sequence, grown."""
        n = len(self.tokens)
        if len(sequence) < n:
            return False
        start = max(0, n - self.TAIL)
        tail = sequence[start:n]
        return (tail.tolist() if isinstance(tail, torch.Tensor) else list(tail)) == self.tokens[start:]

    def update(self, sequence: torch.Tensor | Sequence[int]) -> None:
        """Index the tokens of `sequence` (`(T,)` int64 ids, an extension of the indexed ones: `extends`) past the
        indexed ones: O(new tokens × ngram_size)."""
        new = sequence[len(self.tokens):]
        new = new.tolist() if isinstance(new, torch.Tensor) else list(new)
        tokens, table, size = self.tokens, self.next_at, self.ngram_size
        for token in new:
            p = len(tokens)  # the new token's position: the continuation of the n-grams that end just before it
            for n in range(1, min(size, p) + 1):
                table[tuple(tokens[p - n:p])] = p
            tokens.append(int(token))

    def lookup(self) -> int | None:
        """The token that followed the most recent earlier occurrence of the longest suffix n-gram of the indexed
        sequence (n from `ngram_size` down to 1), or None where no suffix n-gram occurred before."""
        tokens, table = self.tokens, self.next_at
        for n in range(min(self.ngram_size, len(tokens) - 1), 0, -1):
            at = table.get(tuple(tokens[-n:]))
            if at is not None:
                return tokens[at]
        return None
