"""What a step copies host→device: a `Delta`, the entries a layer's resident set lacks, with their slots and K/V, in
host staging before its copy and in a device buffer after it (docs/design.md §2, steps 1 and 3). It knows nothing of
selectors, schedules or caches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Delta:
    """Entries to write into a layer's resident set (`resident_set.ResidentSet`): host staging before the copy, a
    device buffer after it. Buffers hold `capacity` rows; a delta of `count` rows uses the leading ones, so its copy
    is `count` contiguous rows of each tensor.

    Attributes:
        slots: `(capacity,)` int64 flat resident slots. positions: `(capacity,)` int64 token positions.
        keys, values: `(capacity, D)` the entries' K/V.
        count: rows in use.
    """

    slots: torch.Tensor
    positions: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    count: int = 0

    @classmethod
    def empty(cls, capacity: int, dim: int, dtype: torch.dtype, device, pin: bool = False) -> "Delta":
        """Uninitialised buffers of `capacity` rows."""
        return cls(torch.empty(capacity, dtype=torch.long, device=device, pin_memory=pin),
                   torch.empty(capacity, dtype=torch.long, device=device, pin_memory=pin),
                   torch.empty(capacity, dim, dtype=dtype, device=device, pin_memory=pin),
                   torch.empty(capacity, dim, dtype=dtype, device=device, pin_memory=pin))

    @property
    def capacity(self) -> int:
        return self.slots.shape[0]

    def fields(self, rows: int | None = None) -> tuple[torch.Tensor, ...]:
        """The leading `rows` (default `count`) rows of slots, positions, keys and values (contiguous views)."""
        rows = self.count if rows is None else rows
        return self.slots[:rows], self.positions[:rows], self.keys[:rows], self.values[:rows]

    @property
    def nbytes(self) -> int:
        """Bytes of the rows in use: what crosses host→device."""
        return sum(t.nbytes for t in self.fields())
