"""`selector="exact"`: top-k by attention mass over every host key (the reference every other selector is
measured against), scored by the native selection engine."""

from __future__ import annotations

import torch

from ..candidates import Candidates
from .base import Selector


class ExactSelector(Selector):
    """Scores the query against every candidate key of the host store, then token-level top-k by the softmax
    attention mass summed over each GQA group (`Selector.select_exact`: `dual_cache.engine.select` without an index,
    float32 logits, ties to the lower position). Keeps nothing beyond the store; reads every key of the layer each
    step."""

    name = "exact"

    def select(self, query: torch.Tensor, candidates: Candidates, scaling: float,
               budget: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.select_exact(query, candidates, scaling, budget)

    def select_into(self, query: torch.Tensor, candidates: Candidates, scaling: float, budget: int,
                    out: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.select_exact(query, candidates, scaling, budget, out)
