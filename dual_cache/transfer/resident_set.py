"""A layer's resident set (docs/design.md §2, "Pay per step for what changed"): the KV entries the device keeps per
(sequence, KV head) across decode steps, `capacity` of them, and the host's mirror of which position each slot holds.

Each step the host names the positions the step wants resident (the selector's choice and the next positions of
what the real token attended); `plan` finds those not resident yet — the delta — and the slots they go to (empty
slots first, then the least recently used: the entry wanted or attended longest ago), on the host and without asking
the device, because the mirror is updated by every plan in the order the device applies them. Only the delta's
keys and values cross to the device, where `apply` writes them into their slots in stream order. The set's device
bytes are `capacity × (2 × D × dtype + 8)` per (sequence, KV head), independent of the context.

Slots are flat indices `(b · H_kv + h) · capacity + c`, so one `index_copy_` per tensor writes a whole delta. The
plan runs in the native engine's library (`engine/resident_plan.cpp`, a few microseconds per row), with a pure-torch
reference beside it (`_plan_reference`) that tests hold it to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine import native as engine_native
from ..kernels import KVSegment


@dataclass
class Plan:
    """Where a step's delta goes (host tensors, all `(N,)` int64, ordered by (sequence, KV head)).

    Attributes:
        slots: flat resident slots the entries are written into.
        positions: their token positions (-1: the slot is emptied, `exclusive`).
        flat_heads: the flat `(sequence, KV head)` row of each, `b · H_kv + h` over the set's batch.
        The order of the entries is unspecified (their slots are distinct, so `apply` writes them in any order).
        wanted: entries the step wanted resident; resident: how many of them already were (the rest is the delta).
    """

    slots: torch.Tensor
    positions: torch.Tensor
    flat_heads: torch.Tensor
    wanted: int = 0
    resident: int = 0

    @property
    def count(self) -> int:
        return int(self.slots.numel())


class ResidentSet:
    """The resident entries of one full-attention layer, `capacity` per (sequence, KV head).

    Device tensors (made by `allocate`, freed by `free`): `keys`, `values` `(B, H_kv, C, D)`, `positions` `(B, H_kv,
    C)` int64 (-1: empty). Host mirror: `host_positions` `(B, H_kv, C)` int64, what the device holds once every
    planned delta is applied, and `stamps` (the last step each entry was wanted or attended).

    Args:
        batch, kv_heads, capacity, dim: shape (capacity: entries per (sequence, KV head), > 0).
        dtype, device: of the keys and values.
    """

    def __init__(self, batch: int, kv_heads: int, capacity: int, dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        if capacity < 1:
            raise ValueError(f"A resident set needs a capacity >= 1, got {capacity}.")
        self.batch, self.kv_heads, self.capacity, self.dim = batch, kv_heads, capacity, dim
        self.dtype, self.device = dtype, torch.device(device)
        self.host_positions = torch.full((batch, kv_heads, capacity), -1, dtype=torch.long)
        self.stamps = torch.zeros(batch, kv_heads, capacity, dtype=torch.long)
        self.keys = self.values = self.positions = None
        self.step = 0  # plans made (the LRU clock)

    def allocate(self) -> None:
        """Make the device tensors (every slot empty)."""
        shape = (self.batch, self.kv_heads, self.capacity)
        self.keys = torch.zeros(*shape, self.dim, dtype=self.dtype, device=self.device)
        self.values = torch.zeros_like(self.keys)
        self.positions = torch.full(shape, -1, dtype=torch.long, device=self.device)

    @property
    def nbytes(self) -> int:
        """Device bytes of the set (0 before `allocate` and after `free`)."""
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes + self.positions.nbytes

    def plan(self, wanted: torch.Tensor, valid: torch.Tensor, rows: list[int] | None = None,
             used: torch.Tensor | None = None, exclusive: bool = False, native: bool | None = None) -> Plan:
        """Make the `valid` `wanted` positions resident (host side): the positions not resident yet get slots, and the
        mirror records them.

        Args:
            wanted: `(b, H_kv, S)` int64 positions (`S <= capacity`; duplicates allowed).
            valid: `(b, H_kv, S)` bool, which of them are wanted.
            rows: the set's sequences the `b` rows are (None: all, in order).
            used: `(b, H_kv, m)` int64 positions the previous step's real token attended (-1: none), marked used
                now so they are evicted last (LRU); None: none.
            exclusive: also empty every slot not wanted (the plan writes position -1 there): the set then holds
                exactly what this step wants (selectors that choose at the step that uses them, whose attention is
                exactly their choice).

            native: run the native plan (`engine/resident_plan.cpp`; None: when the engine library loads) or the
                pure-torch reference (`_plan_reference`, which defines it: the same slots, positions and mirror).

        Returns:
            The `Plan` (empty when everything wanted is resident).

        Raises:
            ValueError: when a row wants more distinct positions than the capacity (nothing is changed).
        """
        valid = valid & (wanted >= 0)  # a negative position is never wanted, whatever `valid` says
        library = engine_native.library() if native is not False else None
        if native and library is None:
            raise RuntimeError("The native resident-set plan was asked for, but the engine library is unavailable.")
        if library is None:
            return self._plan_reference(wanted, valid, rows, used, exclusive)
        self.step += 1
        ids = torch.arange(self.batch) if rows is None else torch.tensor(rows, dtype=torch.long)
        groups = ids.shape[0] * self.kv_heads
        held = self.host_positions[ids].contiguous()  # copies: the mirror changes only if the plan succeeds
        stamps = self.stamps[ids].contiguous()
        marked = torch.where(valid, wanted, -1).to(torch.long).contiguous()
        used = None if used is None else used.to(torch.long).expand(ids.shape[0], self.kv_heads, -1).contiguous()
        room = groups * max(marked.shape[2], self.capacity)
        group_of, local, positions = (torch.empty(room, dtype=torch.long) for _ in range(3))
        totals = torch.zeros(2, dtype=torch.long)
        count = library.dc_plan(groups, self.capacity, marked.shape[2], 0 if used is None else used.shape[2],
                                held.data_ptr(), stamps.data_ptr(), marked.data_ptr(),
                                None if used is None else used.data_ptr(), self.step, int(exclusive),
                                group_of.data_ptr(), local.data_ptr(), positions.data_ptr(), totals.data_ptr())
        if count < 0:
            self.step -= 1
            raise ValueError(f"A step wants more distinct entries per KV head than the resident set holds "
                             f"({self.capacity}); raise the resident capacity.")
        self.host_positions[ids] = held
        self.stamps[ids] = stamps
        group_of, local, positions = group_of[:count], local[:count], positions[:count]
        flat_heads = ids[torch.div(group_of, self.kv_heads, rounding_mode="floor")] * self.kv_heads + \
            group_of % self.kv_heads
        wanted_total, resident_total = totals.tolist()
        return Plan(flat_heads * self.capacity + local, positions, flat_heads, wanted=wanted_total,
                    resident=resident_total)

    def _plan_reference(self, wanted: torch.Tensor, valid: torch.Tensor, rows: list[int] | None,
                        used: torch.Tensor | None, exclusive: bool) -> Plan:
        """`plan` in plain torch over every row at once (the native plan's definition; arguments as `plan`): keys
        `position + row · span` put every row in a key space of its own, so one `isin` finds what is wanted and
        resident; victims by a stable sort of (empty first, then the last step used)."""
        self.step += 1
        ids = torch.arange(self.batch) if rows is None else torch.tensor(rows, dtype=torch.long)
        held = self.host_positions[ids]  # (b, H, C)
        stamps = self.stamps[ids]
        tops = [int(t.max()) for t in (wanted, held, used) if t is not None and t.numel()]
        span = max(tops, default=0) + 2  # past every position: the rows' key spaces never overlap
        groups = ids.shape[0] * self.kv_heads
        offset = torch.arange(groups).view(-1, self.kv_heads, 1) * span  # one key space per (row, KV head)
        held_keys = torch.where(held >= 0, held + offset, -1)
        want_keys = torch.where(valid, wanted + offset, -2).flatten().unique()  # sorted, distinct
        want_keys = want_keys[want_keys >= 0]
        is_wanted = torch.isin(held_keys, want_keys)
        stamps = torch.where(is_wanted, self.step, stamps)
        if used is not None:
            used_keys = torch.where(used >= 0, used + offset, -3).flatten()
            stamps = torch.where(torch.isin(held_keys, used_keys) & (held >= 0), self.step, stamps)
        missing = want_keys[~torch.isin(want_keys, held_keys.flatten())]
        group_of = torch.div(missing, span, rounding_mode="floor")
        need = torch.bincount(group_of, minlength=groups)  # (b·H,)
        free = (~is_wanted).view(groups, self.capacity)
        if bool((need > free.sum(-1)).any()):
            self.step -= 1
            raise ValueError(f"A step wants more distinct entries per KV head than the resident set holds "
                             f"({self.capacity}); raise the resident capacity.")
        order = torch.where(held.view(groups, -1) < 0, -1, stamps.view(groups, -1))  # empty slots first
        order = torch.where(free, order, torch.iinfo(torch.long).max)  # wanted entries stay
        victims = torch.argsort(order, dim=-1, stable=True)  # (b·H, C)
        rank = torch.arange(missing.numel()) - torch.cumsum(need, 0).sub(need)[group_of]  # j-th miss of its row
        local = victims[group_of, rank]
        positions = missing - group_of * span
        flat_held = held.view(groups, -1)
        flat_held[group_of, local] = positions
        stamps.view(groups, -1)[group_of, local] = self.step
        if exclusive:  # empty what is neither wanted nor just written
            stale = (flat_held >= 0) & ~is_wanted.view(groups, -1)
            stale[group_of, local] = False
            stale_group, stale_slot = stale.nonzero(as_tuple=True)
            flat_held[stale_group, stale_slot] = -1
            group_of = torch.cat([group_of, stale_group])
            local = torch.cat([local, stale_slot])
            positions = torch.cat([positions, torch.full_like(stale_slot, -1)])
        self.host_positions[ids] = held
        self.stamps[ids] = stamps
        b, h = torch.div(group_of, self.kv_heads, rounding_mode="floor"), group_of % self.kv_heads
        flat_heads = ids[b] * self.kv_heads + h
        return Plan(flat_heads * self.capacity + local, positions, flat_heads, wanted=int(want_keys.numel()),
                    resident=int(want_keys.numel() - missing.numel()))

    def carried(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(positions, stamps)` host copies of the mirror: what a request that continues these sequences restores
        (`restore`), kept on the host between requests (no device bytes)."""
        return self.host_positions.clone(), self.stamps.clone()

    def restore(self, positions: torch.Tensor, stamps: torch.Tensor, selectable: torch.Tensor, store) -> int:
        """Fill the set (after `allocate`) with the entries a previous request held (`carried`), on the host and the
        device: those still selectable (`selectable` `(B, end)` bool: a crop, or a window that moved back, drops
        the others), in the same slots when the capacity is the same (so the set evicts as it would have), else the
        most recently used first; their keys and values are read from `store` (the layer's `HostKVStore`). Returns
        the entries restored.

        Args:
            positions, stamps: `(B, H_kv, C')` int64 host tensors (any `C'`).
        """
        end = selectable.shape[1]
        inside = (positions >= 0) & (positions < end)
        keep = inside & torch.gather(selectable[:, None, :].expand(-1, self.kv_heads, -1), 2,
                                     positions.clamp(0, max(end - 1, 0))) if end else torch.zeros_like(inside)
        if positions.shape[2] == self.capacity:  # the same slots (the eviction order breaks ties by slot)
            self.host_positions.copy_(torch.where(keep, positions, -1))
            self.stamps.copy_(torch.where(keep, stamps, 0))
        else:
            order = torch.where(keep, stamps, -1).argsort(dim=-1, descending=True, stable=True)[..., : self.capacity]
            kept = torch.gather(keep, 2, order)
            width = order.shape[2]
            self.host_positions[..., :width] = torch.where(kept, torch.gather(positions, 2, order), -1)
            self.stamps[..., :width] = torch.where(kept, torch.gather(stamps, 2, order), 0)
        self.step = int(self.stamps.max()) if self.stamps.numel() else 0
        slots = (self.host_positions >= 0).flatten().nonzero().flatten()
        if slots.numel():
            flat_heads = torch.div(slots, self.capacity, rounding_mode="floor")
            held = self.host_positions.flatten()[slots]
            keys = torch.empty(slots.numel(), self.dim, dtype=self.dtype)
            values = torch.empty_like(keys)
            store.gather_rows(flat_heads, held, (keys, values))
            self.apply(slots.to(self.device), held.to(self.device), keys.to(self.device), values.to(self.device))
        return int(slots.numel())

    def apply(self, slots: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write a delta into the device set, on the compute stream (after its copy's event): `(N,)` int64 flat
        slots and positions, `(N, D)` keys and values, all on the device."""
        if not slots.numel():
            return
        self.keys.view(-1, self.dim).index_copy_(0, slots, keys)
        self.values.view(-1, self.dim).index_copy_(0, slots, values)
        self.positions.view(-1).index_copy_(0, slots, positions)

    def segment(self) -> KVSegment:
        """The set as an attention segment: every slot, valid where it holds an entry."""
        return KVSegment(self.keys, self.values, self.positions, self.positions >= 0)

    def free(self) -> None:
        """Release the device tensors (the mirror is dropped with the object)."""
        self.keys = self.values = self.positions = None


def attended_entries(segment: KVSegment) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a step attends to in a segment, in a form that does not depend on slot order (tests and checks compare
    runs with it): per (sequence, KV head) the valid entries' positions ascending, then the invalid slots.

    Args:
        segment: `(B, H_kv, C, D)` keys, positions and validity broadcastable to `(B, H_kv, C)`.

    Returns:
        `(positions, valid, keys)`: `(B, H_kv, m)`, `(B, H_kv, m)`, `(B, H_kv, m, D)` host copies, `m` the most valid
        entries of any (sequence, KV head) (positions of invalid slots are -1, their keys 0).
    """
    batch, kv_heads, slots, dim = segment.keys.shape
    positions = segment.positions.expand(batch, kv_heads, slots)
    valid = segment.valid.expand(batch, kv_heads, slots)
    order = torch.where(valid, positions, torch.iinfo(torch.long).max).argsort(dim=-1, stable=True)
    width = int(valid.sum(-1).max()) if valid.numel() else 0
    order = order[..., :width]
    chosen = torch.gather(valid, 2, order)
    keys = torch.gather(segment.keys, 2, order[..., None].expand(-1, -1, -1, dim)) * chosen[..., None]
    return (torch.where(chosen, torch.gather(positions, 2, order), -1).cpu(), chosen.cpu(), keys.cpu())
