"""Speculators: propose the speculated token x̂ whose queries select the next step's KV entries.

`"ngram"` uses transformers' own `PromptLookupCandidateGenerator` (a `CandidateGenerator`) asked for one token.
"""

from __future__ import annotations

import torch
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator


class Speculator:
    """Base: `tokens_per_forward` is 2 (real + speculated token) or 1 (real token only)."""

    tokens_per_forward = 2

    def propose(
        self, input_ids: torch.Tensor, spec_logits: torch.Tensor | None, last_hit: torch.Tensor | None
    ) -> torch.Tensor:
        """Speculated next token per sequence.

        Args:
            input_ids: `(B, T)` int64 sequences including the newest real token.
            spec_logits: `(B, V)` logits at the speculated slot of the last forward (they predict the token
                after the one now being proposed, given the previous speculated token), or None on the first
                decode step.
            last_hit: `(B,)` bool, whether the previous speculated token equalled the real one (then
                `spec_logits` were computed on the true context), or None on the first decode step.

        Returns:
            `(B,)` int64 token ids on `input_ids.device`.
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

    def propose(
        self, input_ids: torch.Tensor, spec_logits: torch.Tensor | None, last_hit: torch.Tensor | None
    ) -> torch.Tensor:
        if spec_logits is None or last_hit is None:
            return self.lookup.propose(input_ids, spec_logits, None)
        chained = spec_logits.argmax(dim=-1).to(input_ids.device)
        missed = (~last_hit).nonzero().flatten().tolist()
        if missed:
            chained[missed] = self.lookup.propose(input_ids[missed], spec_logits[missed], None)
        return chained


class PromptLookupSpeculator(Speculator):
    """Prompt lookup (n-gram match in the sequence so far), one row at a time; where no n-gram matches, the
    model's own argmax (or, on the first step, the newest token)."""

    def __init__(self, ngram_size: int = 3) -> None:
        self.generator = PromptLookupCandidateGenerator(
            num_output_tokens=1, max_matching_ngram_size=ngram_size, max_length=2**62
        )

    def propose(
        self, input_ids: torch.Tensor, spec_logits: torch.Tensor | None, last_hit: torch.Tensor | None
    ) -> torch.Tensor:
        fallback = input_ids[:, -1] if spec_logits is None else spec_logits.argmax(dim=-1).to(input_ids.device)
        proposals = fallback.clone()
        length = input_ids.shape[1]
        for row in range(input_ids.shape[0]):
            candidates, _ = self.generator.get_candidates(input_ids[row : row + 1])
            if candidates.shape[1] > length:
                proposals[row] = candidates[0, length]
        return proposals


class NoSpeculator(Speculator):
    """No speculated token: one token per forward; the real token's query selects for the next step."""

    tokens_per_forward = 1

    def propose(
        self, input_ids: torch.Tensor, spec_logits: torch.Tensor | None, last_hit: torch.Tensor | None
    ) -> torch.Tensor:
        return input_ids[:, -1]


def make_speculator(name: str, ngram_size: int) -> Speculator:
    """The speculator named by `DualDecoderConfig.speculator` (`"self"`, `"ngram"`, `"none"`)."""
    if name == "self":
        return SelfSpeculator(ngram_size)
    if name == "ngram":
        return PromptLookupSpeculator(ngram_size)
    if name == "none":
        return NoSpeculator()
    raise ValueError(f"Unknown speculator {name!r}; choose 'self', 'ngram' or 'none'.")
