"""Prompt lookup kept incrementally for one sequence (`NgramIndex`): the speculators ask it every step, so it pays
per step only for the tokens added since the last question.

Same answer as transformers' `PromptLookupCandidateGenerator` asked for one token: the longest n-gram first (from
`ngram_size` down to 1), the suffix n-gram's continuation at its first (leftmost) earlier occurrence
(`tests/test_speculators.py` compares the two on random sequences). `latest=True` takes the most recent occurrence
instead (the text nearest the cursor; transformers' source marks its leftmost choice as a to-do): measured on the
embedded model it recovered no better after a miss (results/selection/speculator-recovery/README.md), so the
speculators keep the first.
"""

from __future__ import annotations

from typing import Sequence

import torch


class NgramIndex:
    """Every n-gram (n = 1..`ngram_size`) of one token sequence, mapped to where its first (or latest) continuation
    is.

    Keys are the n-gram's token ids packed into one int (`63 // ngram_size` low bits of each), one table per n; a
    match is checked against the tokens themselves, so ids wider than that (a vocabulary over 2^21 tokens at n = 3)
    can only make a packed key collide and lose a match, never return a wrong one. Tokens added a few at a time (a
    decode step's) go to dicts; a long run of them (a prompt) to a sorted run of keys with each key's first (latest)
    continuation, built in a few vectorized passes and searched by bisection, so a 128K-token prompt costs a few
    sorts, not a dict write per n-gram. Lookup takes the first (latest) position the dicts and the runs hold.

    Args:
        ngram_size: the longest n-gram matched (tokens, ≥ 1).
        latest: match the most recent earlier occurrence (default: the first, as transformers).

    Raises:
        ValueError: `ngram_size` < 1.
    """

    TAIL = 8  # tokens compared to tell that a sequence still extends the one indexed (`extends`)
    BULK = 64  # new tokens from which indexing is vectorized

    def __init__(self, ngram_size: int, latest: bool = False) -> None:
        if ngram_size < 1:
            raise ValueError(f"ngram_size must be at least 1, got {ngram_size}.")
        self.ngram_size, self.latest = ngram_size, latest
        self.bits = 63 // ngram_size
        self.tokens: list[int] = []
        # per n (index n - 1): packed n-gram -> position of the token after its first (latest) occurrence
        self.next_at: list[dict[int, int]] = [{} for _ in range(ngram_size)]
        # bulk-indexed runs, oldest first: per n, (sorted packed keys, the first (latest) continuation of each)
        self.runs: list[list[tuple[torch.Tensor, torch.Tensor]]] = []

    def extends(self, sequence: torch.Tensor | Sequence[int]) -> bool:
        """Whether `sequence` (`(T,)` int64 ids) is at least as long as the indexed tokens and ends them the same way
        (its last `TAIL` indexed positions equal): a cheap check that it is the same sequence, grown."""
        n = len(self.tokens)
        if len(sequence) < n:
            return False
        start = max(0, n - self.TAIL)
        tail = sequence[start:n]
        return (tail.tolist() if isinstance(tail, torch.Tensor) else list(tail)) == self.tokens[start:]

    def _key(self, gram: Sequence[int]) -> int:
        key, mask = 0, (1 << self.bits) - 1
        for token in gram:
            key = (key << self.bits) | (token & mask)
        return key

    def update(self, sequence: torch.Tensor | Sequence[int]) -> None:
        """Index the tokens of `sequence` (`(T,)` int64 ids, an extension of the indexed ones: `extends`) past the
        indexed ones: O(new tokens × ngram_size)."""
        old = len(self.tokens)
        new = sequence[old:]
        new = new.tolist() if isinstance(new, torch.Tensor) else list(new)
        if len(new) >= self.BULK:
            self._bulk(torch.as_tensor(self.tokens[max(0, old - self.ngram_size):] + new, dtype=torch.long),
                       max(0, old - self.ngram_size), old)
            self.tokens.extend(new)
            return
        tokens, size = self.tokens, self.ngram_size
        for token in new:
            p = len(tokens)  # the new token's position: the continuation of the n-grams that end just before it
            for n in range(1, min(size, p) + 1):
                if self.latest:
                    self.next_at[n - 1][self._key(tokens[p - n:p])] = p
                else:
                    self.next_at[n - 1].setdefault(self._key(tokens[p - n:p]), p)
            tokens.append(int(token))

    def _bulk(self, segment: torch.Tensor, offset: int, first: int) -> None:
        """Index the continuations at positions ≥ `first` of `segment` (the sequence's tokens from `offset` on)."""
        mask = (1 << self.bits) - 1
        masked = segment & mask
        length = segment.shape[0]
        run: list[tuple[torch.Tensor, torch.Tensor]] = []
        for n in range(1, self.ngram_size + 1):
            starts = max(0, first - n - offset)  # the first n-gram (segment index) whose continuation is new
            count = length - n - starts  # n-grams starting at starts.. whose continuation lies in the segment
            if count <= 0:
                run.append((torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)))
                continue
            keys = torch.zeros(count, dtype=torch.long)
            for j in range(n):
                keys = (keys << self.bits) | masked[starts + j:starts + j + count]
            positions = torch.arange(offset + starts + n, offset + starts + n + count)
            order = torch.argsort(keys, stable=True)  # equal keys stay in position order: first ... latest
            keys, positions = keys[order], positions[order]
            keep = torch.ones(count, dtype=torch.bool)
            if self.latest:
                keep[:-1] = keys[1:] != keys[:-1]
            else:
                keep[1:] = keys[1:] != keys[:-1]
            run.append((keys[keep].contiguous(), positions[keep]))
        self.runs.append(run)

    def _find(self, n: int, key: int) -> int | None:
        """The first (latest) continuation of packed n-gram `key` in the dicts and the runs."""
        at = self.next_at[n - 1].get(key)
        probe = torch.tensor([key])
        for run in self.runs:
            keys, positions = run[n - 1]
            i = int(torch.searchsorted(keys, probe)[0])
            if i < keys.shape[0] and int(keys[i]) == key:
                found = int(positions[i])
                if at is None or (found > at if self.latest else found < at):
                    at = found
        return at

    def lookup(self) -> int | None:
        """The token that followed the first (with `latest`: the most recent) earlier occurrence of the longest suffix
        n-gram of the indexed sequence (n from `ngram_size` down to 1), or None where none occurred before."""
        tokens = self.tokens
        for n in range(min(self.ngram_size, len(tokens) - 1), 0, -1):
            gram = tokens[-n:]
            at = self._find(n, self._key(gram))
            if at is not None and tokens[at - n:at] == gram:
                return tokens[at]
        return None
