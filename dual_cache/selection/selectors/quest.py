"""`selector="quest"`: the Quest baseline (Tang et al., 2024, "Quest: Query-Aware Sparsity for Efficient
Long-Context LLM Inference", §3.2): pages ranked by an upper bound of q·k from per-page key minima and maxima."""

from __future__ import annotations

import torch

from ..candidates import Candidates
from ..quest_pages import page_bounds, select_pages
from .base import Selector, require_block_multiples


class QuestSelector(Selector):
    """Pages of `block_size` consecutive positions (from position 0), each summarised by the element-wise minimum
    and maximum of its keys, kept on the device as Quest keeps them (counted in `device_bytes`: this metadata is
    what the DualDecoder method removes). At the step that uses it, the real token's query ranks pages by
    `Σ_d max(q_d·min_d, q_d·max_d)` summed over the GQA group; the best `budget // block_size` pages are selected
    whole. The metadata covers every stored token, the partial last page included, and is updated as tokens
    arrive."""

    name = "quest"
    prefetched = False
    shares_prefix = False  # its page metadata is per sequence

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.page_min: torch.Tensor | None = None  # (B, H_kv, pages, D) on the device
        self.page_max: torch.Tensor | None = None
        self.indexed = 0  # positions the metadata covers

    @classmethod
    def check_config(cls, config) -> None:
        require_block_multiples(config, cls.name)

    def key_bytes_read(self, end: int, budget: int) -> tuple[int, int]:
        """The page bounds only (min and max key per page; kept on the device)."""
        pages = -(-end // self.config.block_size)
        return pages * 2 * self.store.shape_prefix[1] * self.store.head_dim * self.store.element_size, 0

    def selects_everything(self, candidate_count: int, budget: int) -> bool:
        return False

    def extend(self, length: int, first_real: torch.Tensor, sequences=None) -> None:
        """Recompute the bounds of the pages touched since the last call (from the host keys), up to every stored
        token (at least `length`; the metadata covers the whole batch, whatever `sequences`)."""
        length = max(length, self.store.length)
        page = self.config.block_size
        first = min(self.indexed, length) // page
        pages = -(-length // page)
        if pages <= first:
            self.indexed = length
            return
        self.store.wait_written()
        keys, _ = self.store.read(first * page, length)
        page_min, page_max = (t.to(self.device) for t in page_bounds(keys, page))
        if self.page_min is None or self.page_min.shape[2] < pages:  # grow by whole pages
            grown = [torch.zeros(*page_min.shape[:2], pages, page_min.shape[3], dtype=page_min.dtype,
                                 device=self.device) for _ in range(2)]
            if self.page_min is not None:
                old = self.page_min.shape[2]
                grown[0][:, :, :old], grown[1][:, :, :old] = self.page_min, self.page_max
            self.page_min, self.page_max = grown
        self.page_min[:, :, first:pages] = page_min
        self.page_max[:, :, first:pages] = page_max
        self.indexed = length

    def select(self, query: torch.Tensor, candidates: Candidates, scaling: float,
               budget: int) -> tuple[torch.Tensor, torch.Tensor]:
        pages = -(-candidates.end // self.config.block_size)
        rows = candidates.ids
        indices, valid = select_pages(
            query.to(self.device), self.page_min[rows, :, :pages], self.page_max[rows, :, :pages],
            candidates.mask.to(self.device), budget, self.config.block_size,
        )
        return indices.cpu(), valid.cpu()

    @property
    def device_bytes(self) -> int:
        return 0 if self.page_min is None else self.page_min.nbytes + self.page_max.nbytes

    def free(self) -> None:
        self.page_min = self.page_max = None
