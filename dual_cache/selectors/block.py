"""`selector="block"`: block-level top-k over every host key."""

from __future__ import annotations

import torch

from ..retrieval import select
from .base import Candidates, Selector, require_block_multiples


class BlockSelector(Selector):
    """Exact attention mass of every candidate, summed over blocks of `block_size` consecutive positions that start
    at each sequence's first real token; the `budget // block_size` best blocks are selected whole
    (`retrieval.select_blocks`)."""

    name = "block"

    @classmethod
    def check_config(cls, config) -> None:
        require_block_multiples(config, cls.name)

    def select(self, query: torch.Tensor, candidates: Candidates, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        keys = self.store.key_chunks(candidates.end, candidates.rows)
        return select(query, keys, candidates.mask, self.budget, scaling, self.config.block_size,
                      candidates.first_real)

    def selects_everything(self, candidate_count: int) -> bool:
        return False  # blocks may straddle the candidates' ends: leave repairs on

