"""What a selection is asked for and what it returns, shared by the selectors and the transfer schedule.

`Candidates` are the positions a selector may choose from for one layer's sequences; a `Selection` holds the entries
chosen for one (step, layer): positions, validity and the gathered K/V, in host staging before its copy and in a
device slot after it (docs/design.md §2, steps 1 and 3). Neither type knows selectors, schedules or caches.
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
class Selection:
    """Entries chosen for one (step, layer).

    Attributes:
        indices: `(B, H_kv, k)` int64 positions, ascending.
        valid: `(B, H_kv, k)` bool; False for padding slots.
        keys, values: `(B, H_kv, k, D)` gathered K/V (host staging before the copy, device after).
    """

    indices: torch.Tensor
    valid: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Bytes of the payload that crosses host→device (K, V, indices and validity)."""
        return sum(t.nbytes for t in (self.indices, self.valid, self.keys, self.values))

    @classmethod
    def empty(cls, batch: int, kv_heads: int, tokens: int, dim: int, dtype: torch.dtype, device, pin: bool = False):
        """Uninitialised buffers of `tokens` entries per (sequence, KV head)."""
        return cls(
            torch.empty(batch, kv_heads, tokens, dtype=torch.long, device=device, pin_memory=pin),
            torch.empty(batch, kv_heads, tokens, dtype=torch.bool, device=device, pin_memory=pin),
            torch.empty(batch, kv_heads, tokens, dim, dtype=dtype, device=device, pin_memory=pin),
            torch.empty(batch, kv_heads, tokens, dim, dtype=dtype, device=device, pin_memory=pin),
        )

    def narrow(self, slots: int) -> "Selection":
        """Views of the first `slots` entries of each (sequence, KV head)."""
        return Selection(self.indices[..., :slots], self.valid[..., :slots], self.keys[..., :slots, :],
                         self.values[..., :slots, :])

    def tail(self, start: int) -> "Selection":
        """Views of the entries from slot `start` on."""
        return Selection(self.indices[..., start:], self.valid[..., start:], self.keys[..., start:, :],
                         self.values[..., start:, :])

    def copy_from(self, other: "Selection", non_blocking: bool = False) -> None:
        """Copy `other`'s four tensors into these (same shapes)."""
        for dst, src in zip((self.indices, self.valid, self.keys, self.values),
                            (other.indices, other.valid, other.keys, other.values)):
            dst.copy_(src, non_blocking=non_blocking)


def selection_fields(selection: Selection) -> tuple[torch.Tensor, ...]:
    """The four tensors of `selection` in copy order: indices, valid, keys, values."""
    return selection.indices, selection.valid, selection.keys, selection.values


def compact_positions(positions: torch.Tensor, width: int) -> torch.Tensor:
    """`(B, H_kv, width)`: the largest `width` entries of `positions` `(B, H_kv, n)` (positions, -1 where none), i.e.
    every position when at most `width` are set, padded with -1."""
    if positions.shape[2] >= width:
        return torch.topk(positions, width, dim=-1).values
    return torch.nn.functional.pad(positions, (0, width - positions.shape[2]), value=-1)
