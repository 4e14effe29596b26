"""The interface every selector implements (what it is asked for and what it returns, `Candidates` and `Wanted`,
live in `selection/candidates.py`, shared with the layer's resident set).

A selector decides which middle entries per (sequence, KV head) one full-attention layer's decode step attends to
(docs/design.md §2, step 3). It owns whatever it keeps besides the layer's host store — a host-side index, page
metadata on the device — builds it during prefill, extends it as tokens are committed, and answers
`select(query, candidates, scaling, budget)` on the host. It holds no budget of its own: every call that chooses is
given the number of entries its caller wants (the layer: the request's `fetch_budget`). It knows nothing of
transformers, caches or schedules.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Sequence

import torch

from ... import engine
from ...host.store import HostKVStore
from ...runtime.sync_points import count_host_wait, uncounted
from ..candidates import Candidates, Wanted

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
        store: the layer's host store (every key and value of every sequence).
        device: where the layer's attention runs (a selector may keep state there, counted in `device_bytes`).
        claim_host: called with the byte size of each host allocation the selector is about to make; raises
            `HostMemoryError` past the cache's host-memory limit.
        phase: the layer's index, for a selector that spreads periodic work over the layers of a model.
    """

    name: ClassVar[str] = ""
    prefetched: ClassVar[bool] = True
    shares_prefix: ClassVar[bool] = True  # serves sequences that continue one shared prefix (`share`)

    def __init__(self, config: Any, store: HostKVStore, device: torch.device,
                 claim_host: HostClaim | None = None, phase: int = 0) -> None:
        self.config = config
        self.phase = phase
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

    def key_bytes_read(self, end: int, budget: int) -> tuple[int, int]:
        """Host bytes one sequence's selection of `budget` entries reads at `end` selectable positions (every KV
        head), as `(scanned, gathered)`: `scanned` from data covering every position (keys, key copies, summaries),
        which a batch continuing one shared prefix reads once for all its queries; `gathered` from rows picked for
        that sequence alone. Exact scoring reads every key."""
        return end * self.store.shape_prefix[1] * self.store.head_dim * self.store.element_size, 0

    def selects_everything(self, candidate_count: int, budget: int) -> bool:
        """Whether any query's selection of `budget` entries takes every candidate when there are `candidate_count`
        of them (then a repair with that budget cannot change the selection and is skipped)."""
        return candidate_count <= budget

    def extend(self, length: int, first_real: torch.Tensor, sequences: Sequence[int] | None = None) -> None:
        """Index the committed positions `[0, length)` of some sequences (called per prefill chunk, and by each decode
        step's job before it selects, up to the selectable range; `select` itself never changes the index).

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
        self, query: torch.Tensor, candidates: Candidates, scaling: float, budget: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Choose `budget` entries per (sequence, KV head) that `query` attends to most.

        Args:
            query: `(b, H_q, D)` float32 host queries (after RoPE) of the token predicting the step, one row per
                sequence of `candidates` (`H_q` a multiple of the store's `H_kv`).
            candidates: the selectable positions of those sequences (`end` ≥ 1).
            scaling: the layer's softmax scale (usually `D ** -0.5`).
            budget: entries per (sequence, KV head), > 0: the caller's (the layer's for the running request).

        Returns:
            `(indices, valid)`, both `(b, H_kv, budget)`: int64 positions in `[0, end)`, the valid ones ascending,
            and bool validity (invalid slots hold arbitrary in-range positions and are never attended).
        """
        raise NotImplementedError

    def select_into(self, query: torch.Tensor, candidates: Candidates, scaling: float, budget: int,
                    out: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """`select`, then the chosen keys and values written into `out` (`(b, H_kv, budget, D)` contiguous host
        tensors of the store's dtype; an invalid slot gets the rows of its index, as `HostKVStore.gather`).
        Selectors scored by the native engine gather in the same call."""
        indices, valid = self.select(query, candidates, scaling, budget)
        self.store.gather(indices, out=out, rows=candidates.ids)
        return indices, valid

    def job(self, query: torch.Tensor, ready: Any, candidates: Candidates, scaling: float, budget: int, width: int,
            rows: list[int] | None = None, exact: frozenset[int] = frozenset(),
            follow: tuple[torch.Tensor, Any] | None = None) -> Callable[[], Wanted]:
        """A retrieval job's choice: the positions one step wants resident, for `query` (the gather of the entries
        not resident yet is the resident set's, `layer.DualLayer`).

        Args:
            query: `(B, H_q, D)` float32 host tensor (being filled by a copy from the device until `ready`).
            ready: a CUDA event recorded after that copy, or None (the query is on the host already).
            candidates: the selectable positions of every sequence of the store (`end` may be 0: nothing to
                select; every slot is then invalid).
            scaling: the layer's softmax scale. budget: positions this selector chooses per (sequence, KV head).
            width: slots per (sequence, KV head) of the result, `>= budget`: past `budget`, the *next* position
                of each position in `follow` (`next_positions`; `DualDecoderConfig.fetch_next`).
            rows: None chooses for every sequence; a list for those sequences only (a repair; the result has one
                row per listed sequence), in one call per kind of selection (a sequence's choice depends on it
                alone).
            exact: the sequences (indices into the batch) chosen by `select_exact` instead of this selector's own
                policy: drift repairs (`repair_drift`).
            follow: `(positions, ready)`: the `(B, H_kv, m)` int64 host positions the real token attended in the
                last step (-1 where none; a row whose first entry is `OWN_TOP`: this query's own top entries, a
                request's first step, whose query is the prompt's last token's), being copied until
                `ready.synchronize()` (or `ready` None). None: on a prefetch, every row `OWN_TOP`; on a repair, the
                slots past `budget` stay invalid.

        Returns:
            `choose()`, returning the `Wanted` positions `(b, H_kv, width)` (b: the batch, or `len(rows)`), with the
            attended positions as `used`.
        """
        store = self.store
        batch = query.shape[0]
        ids = list(range(batch)) if rows is None else list(rows)

        def run() -> Wanted:
            if ready is not None:
                count_host_wait("selection query")  # counted on the launching thread only: the synchronous path
                ready.synchronize()
            if follow is not None and follow[1] is not None:
                follow[1].synchronize()
            with uncounted():  # host tensors only from here on
                return _choose()

        def _choose() -> Wanted:
            kv_heads = store.shape_prefix[1]
            positions = torch.zeros(len(ids), kv_heads, width, dtype=torch.long)
            valid = torch.zeros(len(ids), kv_heads, width, dtype=torch.bool)
            if candidates.end == 0 or not ids:  # nothing to choose from: every slot invalid
                return Wanted(positions, valid)
            store.wait_written()
            picked = candidates if rows is None else candidates.subset(ids)
            # index maintenance first (the committed positions up to the step's selectable end), apart from the query
            self.extend(picked.end, picked.first_real, None if picked.sequences is None else list(picked.sequences))
            queries = query if rows is None else query[ids]
            mine = [i for i, row in enumerate(ids) if row not in exact]
            for select, part in ((self.select, mine), (self.select_exact, [i for i in range(len(ids)) if i not in mine])):
                if len(part) == len(ids):
                    positions[..., :budget], valid[..., :budget] = select(queries, picked, scaling, budget)
                elif part:
                    chosen, ok = select(queries[part], picked.subset(part), scaling, budget)
                    positions[part, :, :budget], valid[part, :, :budget] = chosen, ok
            used = None
            if width > budget:
                if follow is not None:
                    used = follow[0] if rows is None else follow[0][ids]
                elif rows is None:  # a request's first step: every row continues this (real) query's own top
                    used = torch.full((batch, 1, 1), OWN_TOP, dtype=torch.long)
                if used is not None:
                    used = self._own_top(used, queries, picked, scaling, width - budget)
                    positions[..., budget:], valid[..., budget:] = next_positions(
                        used, positions[..., :budget], valid[..., :budget], picked.mask, width - budget)
            return Wanted(positions, valid, used)

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
        positions, valid = self.select(query[own], candidates.subset(own), scaling, count)
        out[own] = -1
        out[own, :, :count] = torch.where(valid, positions, -1)
        return out

    def select_exact(self, query: torch.Tensor, candidates: Candidates, scaling: float, budget: int,
                     out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """What `selector="exact"` chooses: top-`budget` by the GQA group's attention mass over every candidate key
        (`dual_cache.engine.select` without an index), whatever this selector's policy; arguments and result as
        `select`, and with `out` the gather of `select_into` in the same engine call. Raises `ValueError` for
        rows outside the store's batch."""
        self.store.flat_rows(candidates.ids, query.shape[0])  # ValueError for rows outside the batch
        keys = self.store.key_chunks(candidates.end)
        values = None if out is None else self.store.value_chunks(candidates.end)
        return engine.select(query.float().contiguous(), candidates.mask, keys, budget, scaling, values=values,
                             out=out, rows=candidates.ids)

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
