"""Speculators: propose the speculated token x̂ whose queries select the next step's KV entries.

`"ngram"` uses transformers' own `PromptLookupCandidateGenerator` (a `CandidateGenerator`) asked for one token.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator


class Speculator:
    """Base: `tokens_per_forward` is 2 (real + speculated token) or 1 (real token only). Speculators run on the host,
    on values the decode loop has read back already (the sampled tokens, the argmax of the speculated slot's
    logits), so proposing never waits for the device."""

    tokens_per_forward = 2

    def propose(self, sequences: Sequence[torch.Tensor], chained: list[int] | None,
                last_hit: list[bool] | None) -> list[int]:
        """Speculated next token per sequence.

        Args:
            sequences: per sequence, its `(T_i,)` int64 host token ids including the newest real token.
            chained: per sequence, the argmax of the speculated slot's logits of the last forward (the model's guess
                for the token after the one now being proposed, given the previous speculated token); None on the
                first decode step.
            last_hit: per sequence, whether the previous speculated token equalled the real one (then `chained`
                was computed on the true context); None on the first decode step.

        Returns:
            One token id per sequence.
        """
        raise NotImplementedError


class SelfSpeculator(Speculator):
    """The model's own greedy guess: argmax of the speculated slot's logits (DualDecoder self-chain).

    Those logits are conditioned on the previous speculated token; where that token missed they are conditioned
    on a wrong context, so those rows (and the first step, which has no speculated logits) try prompt lookup on
    the true sequence first. Under greedy decoding one hit keeps the chain hitting.
    """

    def __init__(self, ngram_size: int = 3) -> None:
        self.lookup = PromptLookupSpeculator(ngram_size)

    def propose(self, sequences: Sequence[torch.Tensor], chained: list[int] | None,
                last_hit: list[bool] | None) -> list[int]:
        if chained is None or last_hit is None:
            return self.lookup.propose(sequences, chained, None)
        proposals = list(chained)
        missed = [i for i, hit in enumerate(last_hit) if not hit]
        if missed:
            looked = self.lookup.propose([sequences[i] for i in missed], [chained[i] for i in missed], None)
            for i, token in zip(missed, looked):
                proposals[i] = token
        return proposals


class PromptLookupSpeculator(Speculator):
    """Prompt lookup (n-gram match in the sequence so far; transformers' `PromptLookupCandidateGenerator`), one row
    at a time; where no n-gram matches, the model's own guess (`chained`) or, on the first step, the newest token."""

    def __init__(self, ngram_size: int = 3) -> None:
        self.generator = PromptLookupCandidateGenerator(
            num_output_tokens=1, max_matching_ngram_size=ngram_size, max_length=2**62
        )

    def propose(self, sequences: Sequence[torch.Tensor], chained: list[int] | None,
                last_hit: list[bool] | None) -> list[int]:
        proposals = []
        for i, sequence in enumerate(sequences):
            candidates, _ = self.generator.get_candidates(sequence[None])
            if candidates.shape[1] > sequence.shape[0]:
                proposals.append(int(candidates[0, sequence.shape[0]]))
            else:
                proposals.append(int(sequence[-1]) if chained is None else chained[i])
        return proposals


class NoSpeculator(Speculator):
    """No speculated token: one token per forward; the real token's query selects for the next step."""

    tokens_per_forward = 1

    def propose(self, sequences: Sequence[torch.Tensor], chained: list[int] | None,
                last_hit: list[bool] | None) -> list[int]:
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
