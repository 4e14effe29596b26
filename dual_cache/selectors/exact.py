"""`selector="exact"`: top-k by attention mass over every host key (the reference every other selector is
measured against), scored by the native selection engine."""

from __future__ import annotations

import torch

from .. import engine
from .base import Candidates, Selector


class ExactSelector(Selector):
    """Scores the query against every candidate key of the host store, then token-level top-k by the softmax
    attention mass summed over each GQA group (`dual_cache.engine.select` without an index: float32 logits, ties
    to the lower position). Keeps nothing beyond the store; reads every key of the layer each step."""

    name = "exact"

    def select(self, query: torch.Tensor, candidates: Candidates, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        keys = self.store.key_chunks(candidates.end, candidates.rows)
        return engine.select(query.float().contiguous(), candidates.mask, keys, self.budget, scaling)

    def select_into(self, query: torch.Tensor, candidates: Candidates, scaling: float,
                    out: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        self.store.first_row(candidates.first_sequence, query.shape[0])  # ValueError for rows outside the batch
        keys = self.store.key_chunks(candidates.end, candidates.rows)
        values = self.store.value_chunks(candidates.end, candidates.rows)
        return engine.select(query.float().contiguous(), candidates.mask, keys, self.budget, scaling,
                             values=values, out=out)
