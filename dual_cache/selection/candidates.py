"""What a selection is asked for and what it returns, shared by the selectors and the layer.

`Candidates` are the positions a selector may choose from for one layer's sequences; `Wanted` the positions a step
wants resident (a selector's job returns them); the layer's resident set turns them into a `Delta`
(`dual_cache/transfer/delta.py`). Neither knows selectors, schedules or caches.
`compact_positions` keeps the positions a step's selection attended, for the next step's (`fetch_next`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Candidates:
    """The positions a selection may choose, for `b` sequences of a layer's host store.

    Attributes:
        mask: `(b, end)` bool host tensor, True at real (non-pad), non-sink positions below `end` (the start of the
            local window).
        first_real: `(b,)` int64 host tensor, each sequence's first real (non-pad) position; selectors that group
            positions (the 2-bit index's groups) start their groups there, so left padding never changes
            what a sequence selects.
        sequences: the store's sequences these rows are, in order (a repair of some sequences of the batch); None:
            the store's first `b` sequences.
    """

    mask: torch.Tensor
    first_real: torch.Tensor
    sequences: tuple[int, ...] | None = None

    @property
    def end(self) -> int:
        """End of the selectable range: positions `[0, end)` (tokens)."""
        return self.mask.shape[1]

    @property
    def ids(self) -> list[int]:
        """The store's sequences these candidates describe, in order."""
        return list(range(self.mask.shape[0])) if self.sequences is None else list(self.sequences)

    def subset(self, rows: list[int]) -> "Candidates":
        """The candidates of these rows (indices into this object's rows) alone."""
        ids = self.ids
        return Candidates(self.mask[rows], self.first_real[rows], tuple(ids[r] for r in rows))


@dataclass
class Wanted:
    """The positions a step wants resident for one layer (host tensors), as a selector's job returns them.

    Attributes:
        positions: `(b, H_kv, S)` int64 positions (the selector's choice, then the next positions of what the real
            token attended).
        valid: `(b, H_kv, S)` bool, which of them are wanted.
        used: `(b, H_kv, m)` int64 positions the previous step's real token attended (-1: none), or None: marked used
            by the resident set (evicted last).
    """

    positions: torch.Tensor
    valid: torch.Tensor
    used: torch.Tensor | None = None


def compact_positions(positions: torch.Tensor, width: int) -> torch.Tensor:
    """`(B, H_kv, width)`: the largest `width` entries of `positions` `(B, H_kv, n)` (positions, -1 where none), i.e.
    every position when at most `width` are set, padded with -1."""
    if positions.shape[2] >= width:
        return torch.topk(positions, width, dim=-1).values
    return torch.nn.functional.pad(positions, (0, width - positions.shape[2]), value=-1)
