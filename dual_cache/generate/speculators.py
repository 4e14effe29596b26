"""Speculators: propose the speculated token x̂ whose queries select the next step's KV entries.

`"ngram"` uses transformers' own `PromptLookupCandidateGenerator` (a `CandidateGenerator`) asked for one token; `"self"`
asks an incremental index of the same n-grams (`ngram_index.NgramIndex`) after a miss.
"""

from __future__ import annotations

from collections import deque
from typing import Hashable, Sequence

import torch
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from .ngram_index import NgramIndex


class Speculator:
    """Base: `tokens_per_forward` is 2 (real + speculated token) or 1 (real token only). Speculators run on the host,
    on values the decode loop has read back already (the sampled tokens, the argmax of the speculated slot's
    logits), so proposing never waits for the device."""

    tokens_per_forward = 2

    def propose(self, sequences: Sequence[torch.Tensor], chained: Sequence[int | None] | None,
                last_hit: Sequence[bool | None] | None, rows: Sequence[Hashable] | None = None) -> list[int]:
        """Speculated next token per sequence.

        Args:
            sequences: per sequence, its `(T_i,)` int64 host token ids including the newest real token.
            chained: per sequence, the argmax of the speculated slot's logits of the last forward (the model's guess
                for the token after the one now being proposed, given the previous speculated token), or None for a
                sequence on its first decode step; None (the whole list) when every sequence is.
            last_hit: per sequence, whether the previous speculated token equalled the real one (then `chained`
                was computed on the true context); None as `chained`.
            rows: per sequence, who it belongs to (a hashable the caller keeps for the request's life: the serving
                `Row`), for speculators that keep per-sequence state; None: the sequence's index in this call (one
                `generate()` request, whose rows keep their order).

        Returns:
            One token id per sequence.
        """
        raise NotImplementedError


class SourceScores:
    """Which guess source was right on a sequence's recent after-miss steps: prompt lookup or the chained guess.

    Args:
        window: after-miss steps remembered (the newest ones).

    Attributes:
        pending: the last after-miss step's `(lookup, chained)` proposals (lookup None where nothing matched),
            scored by `score` once the real token they guessed is known; None when there is none to score.
    """

    def __init__(self, window: int = 8) -> None:
        self.outcomes: deque[tuple[bool, bool]] = deque(maxlen=window)
        self.pending: tuple[int | None, int] | None = None

    def score(self, real: int) -> None:
        """Record whether each pending proposal equalled `real`, the token it guessed."""
        if self.pending is not None:
            looked, chained = self.pending
            self.outcomes.append((looked == real, chained == real))
            self.pending = None

    def prefers_chain(self) -> bool:
        """Whether the chained guess was right more often than lookup on the remembered steps (ties: lookup)."""
        by_lookup = sum(looked for looked, _ in self.outcomes)
        return sum(chained for _, chained in self.outcomes) > by_lookup


class SelfSpeculator(Speculator):
    """The model's own greedy guess: argmax of the speculated slot's logits (DualDecoder self-chain), with prompt
    lookup after a miss (or, with `window`, where lookup has been the better source for that sequence).

    After a hit the chained guess was computed on the true context: under greedy decoding one hit keeps the chain
    hitting, so it is proposed. After a miss it was computed on a wrong context, and prompt lookup on the true
    sequence (`NgramIndex`, n-grams of `ngram_size` down to 1) may know better: text that quotes its prompt (code,
    retrieval answers) is continued by lookup, text in the model's own words by the chain. Each sequence scores both
    sources on its last `window` after-miss steps (`SourceScores`) and proposes the one right more often (ties and
    the first step: lookup; where lookup finds nothing: the chained guess, or on the first step the newest token).

    State is per sequence, keyed by `rows` (`Speculator.propose`); a sequence on its first decode step starts fresh,
    a key absent from a call is forgotten (its request left), and a sequence that does not extend the one indexed
    under its key (another request in that row) is re-indexed and re-scored from nothing.

    Sources: the self-chain is DualDecoder's (the paper, 2026); prompt lookup is prompt lookup decoding (A. Saxena,
    2023), with the answer of transformers' `PromptLookupCandidateGenerator` (the first match; `ngram_index`).

    Args:
        ngram_size: longest n-gram prompt lookup matches (tokens).
        window: after-miss steps each sequence's scores remember; 0 (the library's default) remembers none, so
            every miss proposes lookup where it matches, the chained guess where not. The scored choice (e.g. 8)
            was measured (`results/selection/speculator-recovery/`): the same greedy hit rates, and 0.04–0.05
            lower sampled ones on natural text; it is not the default.
        latest: prompt lookup takes the most recent match instead of the first (`NgramIndex`).

    Raises (`propose`):
        ValueError: when `rows` does not name one owner per sequence.
    """

    def __init__(self, ngram_size: int = 3, window: int = 0, latest: bool = False) -> None:
        self.ngram_size, self.window, self.latest = ngram_size, window, latest
        self.state: dict[Hashable, tuple[NgramIndex, SourceScores]] = {}

    def _row(self, key: Hashable, sequence: torch.Tensor, first: bool) -> tuple[NgramIndex, SourceScores]:
        """The key's index (extended to `sequence`) and scores; new ones on a first step or another sequence."""
        state = self.state.get(key)
        if first or state is None or not state[0].extends(sequence):
            state = (NgramIndex(self.ngram_size, self.latest), SourceScores(self.window))
            self.state[key] = state
        state[0].update(sequence)
        return state

    def propose(self, sequences: Sequence[torch.Tensor], chained: Sequence[int | None] | None,
                last_hit: Sequence[bool | None] | None, rows: Sequence[Hashable] | None = None) -> list[int]:
        keys = list(range(len(sequences))) if rows is None else list(rows)
        if len(keys) != len(sequences):
            raise ValueError(f"rows names {len(keys)} sequences for {len(sequences)}.")
        present = set(keys)
        for key in [key for key in self.state if key not in present]:
            del self.state[key]
        proposals = []
        for i, (key, sequence) in enumerate(zip(keys, sequences)):
            guess = None if chained is None else chained[i]
            hit = None if last_hit is None else last_hit[i]
            index, scores = self._row(key, sequence, guess is None)
            if guess is not None:
                scores.score(int(sequence[-1]))
            if hit:
                proposals.append(int(guess))
                continue
            looked = index.lookup()
            if guess is None:  # the first step: no chained guess to score or fall back on
                proposals.append(int(sequence[-1]) if looked is None else looked)
                continue
            scores.pending = (looked, int(guess))
            proposals.append(int(guess) if looked is None or scores.prefers_chain() else looked)
        return proposals


class PromptLookupSpeculator(Speculator):
    """Prompt lookup (n-gram match in the sequence so far; transformers' `PromptLookupCandidateGenerator`), one row
    at a time; where no n-gram matches, the model's own guess (`chained`) or, on the first step, the newest token."""

    def __init__(self, ngram_size: int = 3) -> None:
        self.generator = PromptLookupCandidateGenerator(
            num_output_tokens=1, max_matching_ngram_size=ngram_size, max_length=2**62
        )

    def propose(self, sequences: Sequence[torch.Tensor], chained: Sequence[int | None] | None,
                last_hit: Sequence[bool | None] | None, rows: Sequence[Hashable] | None = None) -> list[int]:
        proposals = []
        for i, sequence in enumerate(sequences):
            candidates, _ = self.generator.get_candidates(sequence[None])
            if candidates.shape[1] > sequence.shape[0]:
                proposals.append(int(candidates[0, sequence.shape[0]]))
            else:
                guess = None if chained is None else chained[i]
                proposals.append(int(sequence[-1]) if guess is None else int(guess))
        return proposals


class NoSpeculator(Speculator):
    """No speculated token: one token per forward; the real token's query selects for the next step."""

    tokens_per_forward = 1

    def propose(self, sequences: Sequence[torch.Tensor], chained: Sequence[int | None] | None,
                last_hit: Sequence[bool | None] | None, rows: Sequence[Hashable] | None = None) -> list[int]:
        return [int(sequence[-1]) for sequence in sequences]


def make_speculator(name: str, ngram_size: int) -> Speculator:
    """The speculator named by `DualDecoderConfig.speculator` (`"self"`, `"ngram"`, `"none"`)."""
    if name == "self":
        return SelfSpeculator(ngram_size)
    if name == "ngram":
        return PromptLookupSpeculator(ngram_size)
    if name == "none":
        return NoSpeculator()
    raise ValueError(f"Unknown speculator {name!r}; choose 'self', 'ngram' or 'none'.")
