"""Sampled decoding in the evaluation harness: the settings, each (prompt, sample seed)'s torch seed, and labels.

Greedy decoding is the harness's default and is described by `None` everywhere (rows without a `sampling` field).
A `Sampling` decodes every prompt once per sample seed s = 0 … `seeds` - 1; before each `generate()` call the
global torch generator is seeded with `torch_seed(prompt ids, s)`, so every method decoding the same prompt with the
same sample seed starts from the same random state (dense and dual rows are paired by (prompt, sample seed)).

The processors are transformers' own (`generate(do_sample=True, temperature=…, top_p=…, top_k=…)`); top-k 0 and
top-p 1 switch theirs off. All three are always passed: a value left unset would fall back to the model's
`generation_config` and then to transformers' global default (top-k 50).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Sampling:
    """Sampled decoding for `generate()`.

    Attributes:
        temperature: softmax temperature (> 0).
        top_p: nucleus mass kept (0 < top_p ≤ 1; 1 keeps every token).
        top_k: tokens kept by top-k (0 keeps every token).
        seeds: sample seeds per prompt (0 … seeds - 1).

    Raises:
        ValueError: a value outside those ranges.
    """

    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    seeds: int = 1

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (leave it out for greedy decoding), got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top-p must be in (0, 1] (1 keeps every token), got {self.top_p}.")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top-k must be an integer >= 0 (0 keeps every token), got {self.top_k!r}.")
        if isinstance(self.seeds, bool) or not isinstance(self.seeds, int) or self.seeds < 1:
            raise ValueError(f"sampling seeds must be an integer >= 1, got {self.seeds!r}.")

    def settings(self) -> dict[str, Any]:
        """What rows record in their `sampling` field: `{"temperature", "top_p", "top_k"}`."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}

    def generate_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `model.generate()` for these settings (transformers' sampling processors)."""
        return {"do_sample": True, **self.settings()}


def torch_seed(input_ids: list[int], sample_seed: int) -> int:
    """The seed given to `torch.manual_seed` before one `generate()` call: a function of the prompt's token ids and
    the sample seed only (SHA-256 of both, 63 bits), so every method gets the same seed for the same prompt and sample
    seed, and different prompts draw independent streams."""
    digest = hashlib.sha256(f"{sample_seed}:{','.join(map(str, input_ids))}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def settings_text(settings: dict[str, Any] | None) -> str:
    """`"temperature 0.7, top-p 0.9, top-k off"` for a row's `sampling` field; `"greedy"` for None."""
    if settings is None:
        return "greedy"
    top_k = settings.get("top_k") or 0
    top_p = settings.get("top_p", 1.0)
    return (f"temperature {settings['temperature']:g}, top-p {'off' if top_p >= 1 else f'{top_p:g}'}, "
            f"top-k {top_k if top_k else 'off'}")
