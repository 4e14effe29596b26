"""Fidelity to dense attention on long natural text: teacher-forced KL and top-1 agreement, identical greedy length.

Text: `dual_cache.model.needle_prompt.reference_document()` (the Python Language Reference shipped with CPython),
tokenized as plain text (no chat template) from a seeded word offset. A sample of length `L` is a prompt of `L - T - G`
tokens, the next `T` document tokens (the teacher-forced continuation) and `G` greedy steps.

Teacher forcing goes through `generate()` itself, so the dual cache runs its real decode loop (two-token steps,
speculation, retrieval one step ahead): a `ForcedTokens` logits processor records the scores it receives and
then masks every token but the forced one, so the *sequence* follows the forced tokens while `output_logits`
returns each step's raw logits, computed by the method from the forced prefix. (Feeding tokens through repeated
`forward` calls would bypass the dual cache's decode loop and its one-step-ahead selection.) Per method:

1. dense: force the `T` document tokens, then decode `G` tokens greedily (the processor passes them through);
2. every other method: force the same `T` tokens, then force dense's `G` greedy tokens.

Metrics: `kl` — mean over the `T` document positions of KL(p_dense ‖ p_method) in nats, from the raw logits;
`top1` — share of those positions where both argmaxes agree; `identical_tokens` — the first greedy step at which
the method's argmax (of the processed scores, as greedy decoding sees them) differs from dense's token, i.e.
exactly the length of the method's own greedy continuation that equals dense's (until the first difference
both sequences, and so both caches' inputs, are identical). `min_new_tokens` keeps eos out of both runs alike.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from ...model.needle_prompt import reference_document
from .generation import generate
from .methods import Method


class ForcedTokens(LogitsProcessor):
    """Forces `forced[i]` at generation step i (all other scores set to -inf); later steps pass through.

    Records the scores it receives at every step in `seen` (a list of `(V,)` float32 tensors of sequence 0).
    Works for batch size 1 (the harness's case).
    """

    def __init__(self, forced: list[int]):
        self.forced = list(forced)
        self.seen: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        step = len(self.seen)
        self.seen.append(scores[0].detach().float().cpu().clone())
        if step < len(self.forced):
            forced = torch.full_like(scores, float("-inf"))
            forced[:, self.forced[step]] = 0.0
            return forced
        return scores


@dataclass
class FidelitySample:
    """`prompt_ids` (`L - T - G` tokens), the `continuation` (`T` document tokens), `greedy_tokens` `G`, `length` L."""

    length: int
    sample: int
    prompt_ids: list[int]
    continuation: list[int]
    greedy_tokens: int


def make_sample(tokenizer, length: int, sample: int, forced_tokens: int = 64, greedy_tokens: int = 32,
                seed: int = 0) -> FidelitySample:
    """Deterministic natural-text sample (see module docstring).

    Raises:
        ValueError: when `length` cannot hold a prompt of at least 64 tokens plus `forced_tokens + greedy_tokens`,
            or a count is not positive.
    """
    if forced_tokens < 1 or greedy_tokens < 0:
        raise ValueError(f"forced_tokens must be >= 1 and greedy_tokens >= 0, got {forced_tokens}, {greedy_tokens}.")
    prompt_len = length - forced_tokens - greedy_tokens
    if prompt_len < 64:
        raise ValueError(f"length {length} is too short for {forced_tokens} forced + {greedy_tokens} greedy tokens.")
    words = reference_document().split(" ")
    start = random.Random(f"fidelity/{length}/{seed + sample}").randrange(len(words))
    need = prompt_len + forced_tokens
    take = need  # words >= tokens is not guaranteed; grow until enough tokens
    while True:
        chunk = [words[(start + i) % len(words)] for i in range(take)]
        ids = tokenizer(" ".join(chunk), add_special_tokens=False)["input_ids"]
        if len(ids) >= need:
            break
        take *= 2
    return FidelitySample(length, sample, ids[:prompt_len], ids[prompt_len:need], greedy_tokens)


@dataclass
class ForcedRun:
    """One method's teacher-forced run: raw `logits` `(T + G, V)` float32, processed `scores` seen before forcing
    `(T + G, V)`, the `tokens` it emitted (`T + G`), `device_bytes` and wall `seconds`."""

    logits: torch.Tensor
    scores: torch.Tensor
    tokens: list[int]
    device_bytes: int | None
    seconds: float


def forced_run(model, tokenizer, item: FidelitySample, method: Method, forced: list[int]) -> ForcedRun:
    """Run `method` over `item.prompt_ids`, forcing `forced` (len ≤ T + G) and decoding greedily after it."""
    steps = len(item.continuation) + item.greedy_tokens
    processor = ForcedTokens(forced)
    result = generate(
        model, tokenizer, item.prompt_ids, method, steps, logits_processor=LogitsProcessorList([processor]),
        output_logits=True, min_new_tokens=steps,
    )
    logits = torch.stack([step[0].float().cpu() for step in result.output.logits])
    if logits.shape[0] != steps:
        raise RuntimeError(f"{method.label}: expected {steps} steps of logits, got {logits.shape[0]}.")
    return ForcedRun(logits, torch.stack(processor.seen), result.new_ids, result.device_bytes, result.seconds)


def compare(dense: ForcedRun, other: ForcedRun, forced_tokens: int) -> dict:
    """Fidelity of `other` to `dense`: `kl` (nats, mean over the T forced positions), `top1` (0–1), and
    `identical_tokens` over the greedy part (see module docstring)."""
    p = torch.log_softmax(dense.logits[:forced_tokens].double(), dim=-1)
    q = torch.log_softmax(other.logits[:forced_tokens].double(), dim=-1)
    kl = (p.exp() * (p - q)).sum(dim=-1)
    top1 = (dense.logits[:forced_tokens].argmax(-1) == other.logits[:forced_tokens].argmax(-1)).double()
    reference = dense.tokens[forced_tokens:]
    mine = other.scores[forced_tokens:].argmax(-1).tolist()
    identical = next((i for i, (a, b) in enumerate(zip(reference, mine)) if a != b), len(reference))
    return {"kl": float(kl.mean()), "top1": float(top1.mean()), "identical_tokens": identical,
            "greedy_argmax": mine}
