"""`selector="exact"`: top-k by attention mass over every host key (the reference every other selector is
measured against)."""

from __future__ import annotations

import torch

from ..retrieval import select
from .base import Candidates, Selector


class ExactSelector(Selector):
    """Scores the query against every candidate key of the host store, then token-level top-k by the softmax
    attention mass summed over each GQA group (`retrieval.select`). Keeps nothing beyond the store; reads every
    key of the layer each step."""

    name = "exact"

    def select(self, query: torch.Tensor, candidates: Candidates, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        keys = self.store.key_chunks(candidates.end, candidates.rows)
        return select(query, keys, candidates.mask, self.budget, scaling)
