"""The interface every selector implements (what it is asked for and what it fills, `Candidates` and `Selection`,
live in `selection.py`, shared with the transfer schedule).

A selector decides which `budget` middle entries per (sequence, KV head) one full-attention layer's decode step
attends to (docs/design.md §2, step 3). It owns whatever it keeps besides the layer's host store — a host-side index,
page metadata on the device — builds it during prefill, extends it as tokens are committed, and answers
`select(query, candidates)` on the host. It knows nothing of transformers, caches or schedules.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Sequence

import torch

from .. import engine
from ..host_store import HostKVStore
from ..selection import Candidates, Selection
from ..sync_points import count_host_wait, uncounted

HostClaim = Callable[[int], None]  # called with a byte count before host memory is allocated; may raise
OWN_TOP = -2  # a row of attended positions marked so: its query's own top entries stand for them (`Selector.job`)


class Selector:
    """Chooses the entries of one full-attention layer (subclass per policy, one file each, in this package).

    Class attributes:
        name: the `DualDecoderConfig.selector` value that picks this class.
        prefetched: True when the selection is chosen on the host one step ahead from the speculated token's query
            (the DualDecoder pipeline); False when it is chosen at the step that uses it, with the real token's
            query, synchronously (the `"oracle"` upper bound, the Quest baseline).
        shares_prefix: whether it serves a batch of sequences that continue one stored sequence, the prefix kept
            once (`share`).
        repairable: whether miss and drift repair re-select with this selector (prefetched selectors only).

    Args:
        config: the `DualDecoderConfig` (selector options are read from it).
        budget: entries per (sequence, KV head) this layer selects (tokens); > 0. The layer may lower it for a
            request shorter than the budget (the `budget` attribute).
        store: the layer's host store (every key and value of every sequence).
        device: where the layer's attention runs (a selector may keep state there, counted in `device_bytes`).
        claim_host: called with the byte size of each host allocation the selector is about to make; raises
            `HostMemoryError` past the cache's host-memory limit.
    """

    name: ClassVar[str] = ""
    prefetched: ClassVar[bool] = True
    shares_prefix: ClassVar[bool] = True  # serves sequences that continue one shared prefix (`share`)

    def __init__(self, config: Any, budget: int, store: HostKVStore, device: torch.device,
                 claim_host: HostClaim | None = None) -> None:
        self.config = config
        self.budget = budget
        self.store = store
        self.device = torch.device(device)
        self.claim_host = claim_host or (lambda nbytes: None)

    @classmethod
    def check_config(cls, config: Any) -> None:
        """Raise `ValueError` naming the option to change when `config`'s options do not suit this selector."""

    @classmethod
    def host_bytes_for(cls, config: Any, tokens: int, kv_heads: int, head_dim: int, element_size: int) -> int:
        """Host bytes this selector keeps for one sequence whose store holds `tokens` tokens (all KV heads),
        beyond the store's K/V; used to check a request fits in host memory before anything is allocated."""
        return 0

    @property
    def repairable(self) -> bool:
        return self.prefetched

    def key_bytes_read(self, end: int) -> tuple[int, int]:
        """Host bytes one sequence's selection reads at `end` selectable positions (every KV head), as
        `(scanned, gathered)`: `scanned` from data covering every position (keys, key copies, summaries), which a
        batch continuing one shared prefix reads once for all its queries; `gathered` from rows picked for that
        sequence alone. Exact scoring reads every key."""
        return end * self.store.shape_prefix[1] * self.store.head_dim * self.store.element_size, 0

    def selects_everything(self, candidate_count: int) -> bool:
        """Whether any query selects every candidate when there are `candidate_count` of them (then a repair
        cannot change the selection and is skipped)."""
        return candidate_count <= self.budget

    def extend(self, length: int, first_real: torch.Tensor, sequences: Sequence[int] | None = None) -> None:
        """Index the committed positions `[0, length)` of some sequences (called per prefill chunk; decode steps
        extend the index from `select`, up to the selectable range).

        Args:
            length: committed tokens per sequence (tokens); every position below it is final.
            first_real: `(b,)` int64 host, the first real position of the sequences `sequences` (None: the store's
                first `b`; pads before it are never indexed).
        """

    def adopt(self, sources: list[tuple["Selector", int]], length: int, first_real: torch.Tensor) -> None:
        """Index the sequences `regroup` just copied into this selector's (empty-index) store: sequence `i` is
        sequence `row` of `sources[i]`'s store, right-aligned so that its first real position is `first_real[i]`
        (`(B,)` int64 host). The default indexes them anew (`extend`); a selector may copy what it can instead,
        which must give the same index.

        Args:
            sources: `(selector, row)` per sequence of this store. length: the store's positions (tokens).
        """
        self.extend(length, first_real)

    def truncate(self, length: int) -> None:
        """Forget what was indexed at positions `>= length` (the store was cropped to `length` tokens)."""

    def share(self) -> None:
        """The store's one sequence became a prefix several sequences share (`HostKVStore.share`): what was
        indexed for it now serves every sequence. Only called when `shares_prefix`. A selector whose index is per
        sequence copies it per sequence here; `DualDecoderCache.begin_request` has checked its `host_bytes` per added
        sequence against the host-memory limit."""

    def select(
        self, query: torch.Tensor, candidates: Candidates, scaling: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Choose `budget` entries per (sequence, KV head) that `query` attends to most.

        Args:
            query: `(b, H_q, D)` float32 host queries (after RoPE) of the token predicting the step, one row per
                sequence of `candidates` (`H_q` a multiple of the store's `H_kv`).
            candidates: the selectable positions of those sequences (`end` ≥ 1).
            scaling: the layer's softmax scale (usually `D ** -0.5`).

        Returns:
            `(indices, valid)`, both `(b, H_kv, budget)`: int64 positions in `[0, end)`, the valid ones ascending,
            and bool validity (invalid slots hold arbitrary in-range positions and are never attended).
        """
        raise NotImplementedError

    def select_into(self, query: torch.Tensor, candidates: Candidates, scaling: float,
                    out: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """`select`, then the chosen keys and values written into `out` (`(b, H_kv, budget, D)` contiguous host
        tensors of the store's dtype; an invalid slot gets the rows of its index, as `HostKVStore.gather`).
        Selectors scored by the native engine gather in the same call."""
        indices, valid = self.select(query, candidates, scaling)
        self.store.gather(indices, out=out, rows=candidates.ids)
        return indices, valid

    def job(self, query: torch.Tensor, ready: Any, candidates: Candidates, scaling: float,
            rows: list[int] | None = None, exact: frozenset[int] = frozenset(),
            follow: tuple[torch.Tensor, Any] | None = None) -> Callable[[Selection], None]:
        """A retrieval job for the schedule: this selector's choice for `query`, then the gather of the chosen K/V.

        Args:
            query: `(B, H_q, D)` float32 host tensor (being filled by a copy from the device until `ready`).
            ready: a CUDA event recorded after that copy, or None (the query is on the host already).
            candidates: the selectable positions of every sequence of the store (`end` may be 0: nothing to
                select; every slot is then invalid).
            scaling: the layer's softmax scale.
            rows: None selects for every sequence; a list selects for those sequences only (a repair), in one call
                per kind of selection (a sequence's selection depends on it alone), leaving the others' slots
                invalid at 0.
            exact: the sequences (indices into the batch) selected by `select_exact` instead of this selector's
                own policy: drift repairs (`repair_drift`).
            follow: for a staging buffer wider than `budget` (`DualDecoderConfig.fetch_next`): `(positions,
                ready)`, the `(B, H_kv, m)` int64 host positions the real token attended in this step (-1 where
                none; a row whose first entry is `OWN_TOP`: this query's own top entries, a request's first step,
                whose query is the prompt's last token's; being copied until `ready.synchronize()`, or `ready`
                None); the slots past `budget` get the *next* position of each (`next_positions`). None: on a
                prefetch, every row `OWN_TOP`; on a repair, those slots stay invalid.

        Returns:
            `job(staging)`, filling a host `Selection` of shape `(B, H_kv, S, D)` (`S >= budget`) in place.
        """
        store = self.store
        batch = query.shape[0]

        def run(staging: Selection) -> None:
            if ready is not None:
                count_host_wait("selection query")  # counted on the launching thread only: the synchronous path
                ready.synchronize()
            if follow is not None and follow[1] is not None:
                follow[1].synchronize()
            with uncounted():  # host tensors only from here on
                _select(staging)

        def _select(full: Selection) -> None:
            if candidates.end == 0:  # every slot invalid; its K/V zeroed too, as a slot's bytes reach attention
                for tensor in (full.indices, full.valid, full.keys, full.values):
                    tensor.zero_()
                return
            store.wait_written()
            staging = full.narrow(self.budget)
            every = rows is None and len(exact) in (0, batch)
            if every:
                out = (staging.keys, staging.values)
                indices, valid = (self.select_exact(query, candidates, scaling, out) if exact
                                  else self.select_into(query, candidates, scaling, out))
                staging.indices.copy_(indices)
                staging.valid.copy_(valid)
            else:
                staging.indices.zero_()
                staging.valid.zero_()
                chosen = list(range(batch)) if rows is None else list(rows)
                for select, ids in ((self.select_into, [r for r in chosen if r not in exact]),
                                    (self.select_exact, [r for r in chosen if r in exact])):
                    if ids:
                        shape = (len(ids), *staging.keys.shape[1:])
                        out = (torch.empty(shape, dtype=staging.keys.dtype),
                               torch.empty(shape, dtype=staging.keys.dtype))
                        indices, valid = select(query[ids], candidates.subset(ids), scaling, out)
                        staging.indices[ids], staging.valid[ids] = indices, valid
                        staging.keys[ids], staging.values[ids] = out
            extra = full.indices.shape[2] - self.budget
            if extra:
                attended = None
                if follow is not None:
                    attended = follow[0]
                elif rows is None:  # a request's first step: every row continues this (real) query's own top
                    attended = torch.full((batch, 1, 1), OWN_TOP, dtype=torch.long)
                if attended is not None:
                    attended = self._own_top(attended, query, candidates, scaling, extra)
                self._fill_next(full.tail(self.budget), staging, attended, candidates)

        return run

    def _own_top(self, attended: torch.Tensor, query: torch.Tensor, candidates: Candidates, scaling: float,
                 count: int) -> torch.Tensor:
        """`attended` `(B, H_kv or 1, m)` with each row marked `OWN_TOP` (a request's first step: the query is the
        prompt's last token's, a real one) replaced by the top `count` positions of that row's own query."""
        own = [b for b in range(attended.shape[0]) if int(attended[b, 0, 0]) == OWN_TOP]
        if not own:
            return attended
        kv_heads = self.store.shape_prefix[1]
        width = max(count, attended.shape[2])
        out = torch.full((attended.shape[0], kv_heads, width), -1, dtype=torch.long)
        out[..., :attended.shape[2]] = attended
        budget, self.budget = self.budget, count
        try:
            positions, valid = self.select(query[own], candidates.subset(own), scaling)
        finally:
            self.budget = budget
        out[own] = -1
        out[own, :, :count] = torch.where(valid, positions, -1)
        return out

    def _fill_next(self, tail: Selection, chosen: Selection, attended: torch.Tensor | None,
                   candidates: Candidates) -> None:
        """Fill `tail` `(B, H_kv, m[, D])` with the next position of each `attended` position `(B, H_kv, n)` (-1:
        none; None: every tail slot invalid): a candidate that `chosen` (the leading slots) does not hold already,
        with its K/V (`next_positions`)."""
        tail.indices.zero_()
        tail.valid.zero_()
        if attended is None:
            tail.keys.zero_()
            tail.values.zero_()
            return
        width = tail.indices.shape[2]
        positions, valid = next_positions(attended, chosen.indices, chosen.valid, candidates.mask, width)
        tail.indices.copy_(positions)
        tail.valid.copy_(valid)
        self.store.gather(positions, out=(tail.keys, tail.values), rows=candidates.ids)

    def select_exact(self, query: torch.Tensor, candidates: Candidates, scaling: float,
                     out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """What `selector="exact"` chooses: top-`budget` by the GQA group's attention mass over every candidate key
        (`dual_cache.engine.select` without an index), whatever this selector's policy; arguments and result as
        `select`, and with `out` the gather of `select_into` in the same engine call. Raises `ValueError` for
        rows outside the store's batch."""
        self.store.own_rows(candidates.ids, query.shape[0])  # ValueError for rows outside the batch
        keys = self.store.key_chunks(candidates.end)
        values = None if out is None else self.store.value_chunks(candidates.end)
        return engine.select(query.float().contiguous(), candidates.mask, keys, self.budget, scaling,
                             values=values, out=out, rows=candidates.ids)

    @property
    def host_bytes(self) -> int:
        """Host bytes held beyond the store's K/V (an index, a key copy)."""
        return 0

    @property
    def device_bytes(self) -> int:
        """Device bytes held (0 for the DualDecoder selectors: nothing but selected entries lives there)."""
        return 0

    def free(self) -> None:
        """Release what the selector holds. Idempotent."""


def require_block_multiples(config: Any, selector: str) -> None:
    """Raise `ValueError` unless every budget of `config` (budget, early_layer_budget, each `layer_budgets` entry)
    is a multiple of `config.block_size` — for selectors that select whole pages (`"quest"`)."""
    budgets = [("budget", config.budget), ("early_layer_budget", config.early_layer_budget),
               *[(f"layer_budgets[{i}]", b) for i, b in config.layer_budgets.items()]]
    for name, value in budgets:
        if value % config.block_size:
            raise ValueError(
                f"`{name}`={value} must be a multiple of `block_size`={config.block_size} with "
                f"selector={selector!r}; change the budget or the block size."
            )


def next_positions(attended: torch.Tensor, chosen: torch.Tensor, chosen_valid: torch.Tensor, mask: torch.Tensor,
                   width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The next position of each attended entry, for the entries a copy continues into (induction: a token that
    attended to position `p` is most often followed by one that attends to `p + 1`).

    Args:
        attended: `(b, H_kv, n)` int64 positions the real token attended, -1 where none.
        chosen, chosen_valid: `(b, H_kv, k)` the positions already selected (and which of them are valid).
        mask: `(b, end)` bool selectable positions.
        width: slots of the result.

    Returns:
        `(positions, valid)`, `(b, H_kv, width)`: `p + 1` for attended `p` where `p + 1` is selectable and not
        among the valid `chosen`, ascending in the valid slots; 0 and False elsewhere.
    """
    end = mask.shape[1]
    after = attended + 1
    ok = (attended >= 0) & (after < end)
    after = torch.where(ok, after, 0)
    ok &= torch.gather(mask[:, None, :].expand(-1, attended.shape[1], -1), 2, after)
    held = torch.where(chosen_valid, chosen, end).sort(dim=-1).values
    spot = torch.searchsorted(held, after.contiguous()).clamp_(max=held.shape[-1] - 1)
    ok &= torch.gather(held, 2, spot) != after
    key = torch.where(ok, after, end + 1)  # valid first, in ascending order
    take = min(width, key.shape[-1])
    order = key.sort(dim=-1).values[..., :take]
    positions = torch.zeros(*attended.shape[:2], width, dtype=torch.long)
    valid = torch.zeros(*attended.shape[:2], width, dtype=torch.bool)
    valid[..., :take] = order < end
    positions[..., :take] = torch.where(valid[..., :take], order, 0)
    return positions, valid
