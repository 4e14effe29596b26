"""Host selection engine: one call per (layer, step) chooses the top-`budget` entries of every (sequence, KV head).

`select` runs the native engine (`selection_engine.cpp`, built and loaded by `native.py`; GIL released,
multi-threaded over sequences and KV heads, CPU features detected at run time) or, where it cannot be built, the
pure-torch reference (`reference.py`, which defines every number the engine computes). `codes.py` holds the 2-bit key
index's storage format. The engine knows nothing of transformers, caches or selectors' policies.

A call's Python work does not grow with the batch: the engine computes every (sequence, KV head)'s addresses from
the chunks' and the index's strides, and a caller that selects every step over the same store prepares its chunks
once (`Chunks`).
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Sequence

import torch

from ..runtime.sync_points import uncounted
from . import native, profiling, reference
from .codes import GROUP, KEY_TYPES, padded_dim


@dataclass(frozen=True)
class IndexView:
    """The 2-bit key index of a store's sequences as the engine reads it (`codes.py`).

    Attributes:
        packed: `(B, H_kv, capacity, D_q / 4, 64)` uint8: the 64-byte line of each (group, channel quad) (`codes.py`),
            every sequence of the store. Any strides with contiguous lines; the `lowbit` selector stores each quad's
            lines of all groups one after another, so a scan reads one stream per quad it reads.
        params: `(B, H_kv, capacity, 2, D_q)` bfloat16 per-channel minimum and step of each group, contiguous per
            (sequence, KV head).
        group_first: `(B,)` int64 contiguous, each stored sequence's first position of group 0.
        n_groups: `(B,)` int64 contiguous, complete groups indexed per stored sequence (a call uses those that lie
            wholly below its `end`, `usable`).
    """

    packed: torch.Tensor
    params: torch.Tensor
    group_first: torch.Tensor
    n_groups: torch.Tensor

    def usable(self, end: int) -> torch.Tensor:
        """`(B,)` int64: the groups that lie wholly below `end`."""
        fit = torch.div(end - self.group_first, GROUP, rounding_mode="floor").clamp_(min=0)
        return torch.minimum(self.n_groups, fit)

    @cached_property
    def native(self) -> tuple[ctypes.Array, torch.Tensor, torch.Tensor]:
        """What the engine reads (computed once per view): the addresses and byte strides of the codes and the
        parameters (`selection_engine.cpp`, `Index`), and contiguous int64 group starts and counts."""
        packed, params = self.packed, self.params
        if packed.shape[-1] != 64 or packed.stride(-1) != 1 or params.stride(-1) != 1 \
                or params.stride(-2) != params.shape[-1] or params.stride(-3) != 2 * params.shape[-1]:
            raise ValueError("The index's code lines (last axis of 64 bytes) and its parameters per (sequence, KV "
                             "head) must be contiguous.")
        table = _int64s([packed.data_ptr(), packed.stride(0), packed.stride(1), packed.stride(3), packed.stride(2),
                         params.data_ptr(), params.stride(0) * 2, params.stride(1) * 2])
        return table, self.group_first.to(torch.long).contiguous(), self.n_groups.to(torch.long).contiguous()


@dataclass(frozen=True)
class CarriedPool:
    """The carried pools of a store's (sequence, KV head)s and their scan schedule (the `carried` selector): a
    selection that does not scan rescores its task's pool, plus the positions appended since, instead of every
    key's code. `select` decides per task, before any work, and updates these arrays in place.

    Attributes (contiguous host tensors over the stored sequences `B` and KV heads; `P` slots, query width `G·D`):
        positions: `(B, H_kv, P)` int64: the first `counts` slots hold, ascending, the `P` positions of highest
            exact attention mass among those the task's last scan rescored (all of them when fewer).
        counts: `(B, H_kv)` int64, the valid slots (0: the task scans at its next selection).
        due: `(B, H_kv)` int64, pooled selections left before the task's next scan.
        fresh_from: `(B, H_kv)` int64, the selectable end (positions) at the task's last scan: positions from here
            on are rescored whole by a pooled selection; a selection whose end lies below it scans (a crop lowers it:
            the `carried` selector's `truncate`).
        query: `(B, H_kv, G·D)` float32, the GQA group's query of the task's last scan.
        tally: `(B, H_kv, 2)` int64, the task's scans and pooled selections so far.
        interval: a scanning task waits `interval - 1` pooled selections (its first scan after `counts` was 0:
            `(phase + KV head) % interval`, so a model's layers and heads do not all scan in one step).
        cosine: a task whose query's cosine to its last scan's is below this scans at once (None: never early).
        phase: the layer's index (the stagger above).

    Raises:
        ValueError: on shapes, dtypes or layouts other than the above.
    """

    positions: torch.Tensor
    counts: torch.Tensor
    due: torch.Tensor
    fresh_from: torch.Tensor
    query: torch.Tensor
    tally: torch.Tensor
    interval: int
    cosine: float | None
    phase: int

    def __post_init__(self) -> None:
        batch_heads = tuple(self.positions.shape[:2])
        layout = [(self.positions, torch.long, 3), (self.counts, torch.long, 2), (self.due, torch.long, 2),
                  (self.fresh_from, torch.long, 2), (self.query, torch.float32, 3), (self.tally, torch.long, 3)]
        if any(t.dtype != dtype or t.dim() != dims or tuple(t.shape[:2]) != batch_heads or not t.is_contiguous()
               or t.device.type != "cpu" for t, dtype, dims in layout) or self.tally.shape[2] != 2 \
                or not 1 <= self.interval < 2**62 or not 0 <= self.phase < 2**62:
            raise ValueError("A CarriedPool needs contiguous host tensors over (B, H_kv): positions (B, H_kv, P), "
                             "counts, due, fresh_from (B, H_kv) int64, query (B, H_kv, G·D) float32, tally (B, H_kv, "
                             "2) int64; an interval in [1, 2**62) and a phase in [0, 2**62).")

    @cached_property
    def native(self) -> ctypes.Array:
        """`selection_engine.cpp`'s `Pool` fields (computed once per pool)."""
        return _int64s([self.positions.data_ptr(), self.counts.data_ptr(), self.positions.shape[2],
                        self.due.data_ptr(), self.fresh_from.data_ptr(), self.query.data_ptr(),
                        self.tally.data_ptr(), self.interval, self.phase])


@dataclass(frozen=True)
class Chunks:
    """A store's key chunks (and value chunks, for the gather) checked and laid out for the engine once (`chunks`),
    for a caller that selects over the same chunks call after call.

    Attributes:
        keys, values: the chunks as given (values None: no gather). positions: the positions they hold.
    """

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...] | None
    positions: int
    table: ctypes.Array = field(repr=False)  # `selection_engine.cpp`'s `Seg` fields per chunk


def chunks(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor] | None = None) -> Chunks:
    """Check `keys` (and `values`) as `select` would and lay them out for the engine.

    Args:
        keys: key chunks covering positions `[0, n)` in order, each `(B or 1, H_kv, n_i, D)` float32 / bfloat16 /
            float16 with contiguous rows (a chunk of batch 1 is shared by every sequence).
        values: the matching value chunks (same shapes and dtype, contiguous rows), or None.

    Raises:
        ValueError: naming what to change.
    """
    keys = tuple(keys)
    if not keys:
        raise ValueError("select needs at least one key chunk.")
    dim = keys[0].shape[-1]
    if keys[0].dtype not in KEY_TYPES or any(c.dtype != keys[0].dtype or c.dim() != 4 or c.shape[-1] != dim
                                             or c.shape[1] != keys[0].shape[1] or c.stride(-1) != 1
                                             or c.stride(-2) != dim for c in keys):
        raise ValueError("select needs float32/bfloat16/float16 key chunks (B or 1, H_kv, n, D) of one dtype with "
                         "contiguous rows.")
    if values is not None:
        values = tuple(values)
        if len(values) != len(keys) or any(v.shape != k.shape or v.dtype != k.dtype or v.stride(-1) != 1
                                           or v.stride(-2) != v.shape[-1] for k, v in zip(keys, values)):
            raise ValueError("select's `values` must match `keys` chunk by chunk (shapes, dtype, contiguous rows).")
    table, start = [], 0
    for i, chunk in enumerate(keys):
        element = chunk.element_size()
        fields = [start, chunk.shape[2]]
        for tensor in (chunk, None if values is None else values[i]):
            if tensor is None:
                fields += [0, 0, 0]
            else:  # a chunk of batch 1 serves every sequence: sequence stride 0
                fields += [tensor.data_ptr(), 0 if tensor.shape[0] == 1 else tensor.stride(0) * element,
                           tensor.stride(1) * element]
        table += fields
        start += chunk.shape[2]
    return Chunks(keys, values, start, _int64s(table))


def select(query: torch.Tensor, mask: torch.Tensor, keys: Sequence[torch.Tensor] | Chunks, budget: int,
           scaling: float, index: IndexView | None = None, shortlist: int = 0, quads: int | None = None,
           threads: int | None = None, values: Sequence[torch.Tensor] | None = None,
           out: tuple[torch.Tensor, torch.Tensor] | None = None,
           rows: Sequence[int] | None = None, pool: CarriedPool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-`budget` positions per (sequence, KV head) by group attention mass, optionally among a shortlist, and
    optionally the gather of the selected keys and values into `out` in the same call.

    Without `index` every candidate is scored exactly ("exact"). With it, a scan of the 2-bit codes of `quads`
    channel quads (the rest enter at each group's midpoint) shortlists `shortlist` positions per (sequence, KV
    head); they and the candidates the index does not cover are scored exactly (`reference.py` gives the
    definitions). One engine call serves every query row.

    Args:
        query: `(b, H_q, D)` float32 host queries (after RoPE); `H_q` a multiple of `H_kv`.
        mask: `(b, end)` bool host, True at selectable positions.
        keys: the host store's key chunks covering positions `[0, ≥ end)` in order, each `(B or 1, H_kv, n_i, D)`
            float32 / bfloat16 / float16 with contiguous rows (a chunk of batch 1 is shared by every sequence); or
            `Chunks` prepared from them (and the value chunks) once.
        budget: positions per (sequence, KV head); scaling: the softmax scale.
        index: the store's 2-bit key index, or None.
        shortlist: positions the scan keeps per (sequence, KV head).
        quads: channel quads (4 channels each) the scan reads, 1 .. `padded_dim(D) / 4`; None: all of them.
        threads: host threads (default `torch.get_num_threads()`); the result does not depend on it. The
            (sequence, KV head) tasks are divided among them, and with more threads than tasks each task's scan
            and exact stage are split over several (docs/host-selection-engine.md, "Threads"); the threads are kept
            between calls (`native.library().dc_release_scratch()` stops them and frees the scratch memory).
        values: the value chunks matching `keys` (same shapes and dtype), to gather with `out` (with `Chunks`: None,
            the prepared values are used).
        out: `(keys_out, values_out)`, each `(b, H_kv, budget, D)` in the keys' dtype, contiguous or the first
            `budget` slots of a contiguous `(b, H_kv, S, D)` tensor (`S >= budget`): filled with the rows at the
            returned indices (an invalid slot gets position 0's rows, as `HostKVStore.gather` of the indices would).
        rows: the store's sequences (rows of the chunks and of the index) that the `b` queries belong to, in
            order; None: `0 … b - 1`. A subset costs only its own work (the repair of some sequences of a batch).
        pool: the store's carried pools and their schedule (`CarriedPool`, rows as the chunks'), or None. With
            it, each (query row, KV head) either scans and writes its pool, or rescores its pool plus the positions
            appended since (`CarriedPool`; `reference.select` defines both); the query rows' stored sequences must
            be distinct.

    Returns:
        `(indices, valid)`, both `(b, H_kv, budget)`: int64 positions, ascending where valid (0 elsewhere), bool.

    Raises:
        ValueError: on inconsistent shapes or dtypes (before any work).
    """
    with uncounted():  # host tensors only (the decode step's host waits are counted where they happen)
        if isinstance(keys, Chunks):
            if values is not None:
                raise ValueError("select takes the values from `Chunks` when given them; pass `values=None`.")
        elif (values is None) != (out is None):
            raise ValueError("select gathers with both `values` and `out`, or neither.")
        prepared = keys if isinstance(keys, Chunks) else chunks(keys, values)
        return _select(query, mask, prepared, budget, scaling, index, shortlist, quads, threads, out, rows, pool)


_RANGES: dict[int, ctypes.Array] = {}  # batch -> rows 0 … batch - 1 as a ctypes array


def _select(query, mask, prepared: Chunks, budget, scaling, index, shortlist, quads, threads, out, rows,
            pool=None):
    batch, q_heads, dim = query.shape
    keys = prepared.keys
    stored = max(chunk.shape[0] for chunk in keys)
    if index is not None:
        stored = max(stored, index.packed.shape[0])
    if rows is None:
        row_array = _RANGES.get(batch) or _RANGES.setdefault(batch, _int64s(range(batch)))
    else:
        row_array = _int64s(rows)
    if len(row_array) != batch or batch and stored > 1 and (min(row_array) < 0 or max(row_array) >= stored):
        raise ValueError(f"select needs one store row (< {stored}) per query row, got rows {list(row_array)} for "
                         f"{batch} queries.")
    if pool is not None:
        _check_pool(pool, stored, keys[0].shape[1], q_heads // keys[0].shape[1] * dim, row_array)
    kv_heads = keys[0].shape[1]
    if out is not None:
        if prepared.values is None:
            raise ValueError("select gathers with both `values` and `out`, or neither.")
        shape = (batch, kv_heads, budget, dim)
        if len(out) != 2 or any(o.shape != shape or o.dtype != keys[0].dtype or out_slots(o) is None
                                or o.device.type != "cpu" for o in out) or out_slots(out[0]) != out_slots(out[1]):
            raise ValueError(f"select's `out` must be two host tensors of shape {shape} and dtype {keys[0].dtype}, "
                             "contiguous or the leading slots of contiguous (b, H_kv, S, D) tensors alike.")
    if query.dtype != torch.float32 or q_heads % kv_heads or mask.shape[0] != batch or mask.dtype != torch.bool:
        raise ValueError(f"select needs float32 queries (b, H_q, D) with H_q a multiple of H_kv={kv_heads} and a "
                         f"(b, end) bool mask; got query {tuple(query.shape)} {query.dtype}, mask "
                         f"{tuple(mask.shape)} {mask.dtype}.")
    if keys[0].shape[-1] != dim:
        raise ValueError(f"select needs key chunks of {dim} channels (the queries'), got {keys[0].shape[-1]}.")
    end = mask.shape[1]
    if prepared.positions < end:
        raise ValueError(f"The key chunks hold {prepared.positions} positions, fewer than end={end}.")
    all_quads = padded_dim(dim) // 4
    quads = all_quads if quads is None else quads
    if isinstance(quads, bool) or not isinstance(quads, int) or not 1 <= quads <= all_quads:
        raise ValueError(f"select needs 1 <= quads <= {all_quads} (channel quads of a {dim}-channel head), got "
                         f"{quads!r}.")
    library = native.library()
    if library is None or budget == 0 or end == 0:
        return _reference_select(query, mask, prepared, budget, scaling, index, shortlist, quads, out,
                                 list(row_array), pool)
    return _native_select(library, query if query.is_contiguous() else query.contiguous(),
                          mask if mask.is_contiguous() else mask.contiguous(), prepared, budget, scaling, index,
                          shortlist, torch.get_num_threads() if threads is None else threads, quads, out, row_array,
                          pool)


def _check_pool(pool: CarriedPool, stored: int, kv_heads: int, width: int, rows) -> None:
    """ValueError naming the fix where `pool` does not fit the call."""
    batch, heads = pool.positions.shape[:2]
    if batch < stored or heads != kv_heads or pool.query.shape[2] != width:
        raise ValueError(f"The carried pool is over {batch} sequences × {heads} KV heads with queries of "
                         f"{pool.query.shape[2]} floats; the call needs {stored} × {kv_heads} and {width}.")
    if len(rows) and max(rows) >= batch:
        raise ValueError(f"The carried pool holds {batch} sequences; the call's rows reach {max(rows)}.")
    if len(set(rows)) != len(rows):
        raise ValueError("select with a carried pool needs distinct stored sequences per query row.")


def out_slots(out: torch.Tensor) -> int | None:
    """Rows per (sequence, KV head) of the contiguous tensor `out` `(b, H_kv, k, D)` is the first `k` slots of (its
    own `k` when contiguous), or None when it is not laid out that way."""
    batch, kv_heads, _, dim = out.shape
    slots = out.stride(1) // dim if dim else 0
    if out.stride(-1) != 1 or out.stride(-2) != dim or out.stride(1) != slots * dim or slots < out.shape[2] \
            or (batch > 1 and out.stride(0) != kv_heads * slots * dim):
        return None
    return slots


def _reference_select(query, mask, prepared, budget, scaling, index, shortlist, quads, out, rows, pool=None):
    """`select` by `reference.py` (where the engine cannot be built, or has nothing to do)."""
    picked = [chunk if chunk.shape[0] == 1 else chunk[rows] for chunk in prepared.keys]
    view = None
    if index is not None:
        usable = index.usable(mask.shape[1])
        view = (index.packed[rows], index.params[rows], index.group_first[rows], usable[rows])
    carried = None if pool is None else (pool, rows)
    indices, valid = reference.select(query, mask, picked, budget, scaling, view, shortlist, quads, carried)
    if out is not None:
        reference.gather(picked, indices, out[0])
        reference.gather([chunk if chunk.shape[0] == 1 else chunk[rows] for chunk in prepared.values], indices,
                         out[1])
    return indices, valid


def _pool_args(pool: CarriedPool | None) -> tuple:
    """`dc_select`'s carried-pool arguments (none: a null pointer)."""
    if pool is None:
        return None, 0.0
    return pool.native, float("nan") if pool.cosine is None else float(pool.cosine)


def _int64s(values) -> ctypes.Array:
    """A ctypes int64 array of `values` (cheaper per call than building small torch tensors)."""
    values = list(values)
    return (ctypes.c_int64 * len(values))(*values)


def _native_select(library, query, mask, keys, budget, scaling, index, shortlist, threads, quads=None, out=None,
                   rows=None, pool=None):
    """One `dc_select` call. `keys`: `Chunks` (or key chunks, without a gather); `index`: an `IndexView` or None;
    `rows`: the stored sequence of each query row (a ctypes int64 array or a sequence; None: `0 … b - 1`);
    `pool`: a `CarriedPool` or None."""
    prepared = keys if isinstance(keys, Chunks) else chunks(keys)
    batch, q_heads, dim = query.shape
    kv_heads = prepared.keys[0].shape[1]
    if rows is None or not isinstance(rows, ctypes.Array):
        rows = _int64s(range(batch) if rows is None else rows)
    out_keys = out_values = None
    slots = budget
    if out is not None:
        out_keys, out_values = out[0].data_ptr(), out[1].data_ptr()
        slots = out_slots(out[0])
    indices = torch.empty(batch, kv_heads, budget, dtype=torch.long)
    valid = torch.empty(batch, kv_heads, budget, dtype=torch.bool)
    table = group_first = n_groups = None
    dim_q = padded_dim(dim)
    quads = dim_q // 4 if quads is None else quads
    if index is not None:
        table, first, groups = index.native
        group_first, n_groups = first.data_ptr(), groups.data_ptr()
    profile = profiling.buffer(batch * kv_heads)
    started = time.thread_time_ns() if profile is not None else 0
    status = library.dc_select(
        batch, kv_heads, q_heads // kv_heads, dim, KEY_TYPES[prepared.keys[0].dtype], query.data_ptr(), scaling,
        mask.shape[1], mask.data_ptr(), rows, len(prepared.keys), prepared.table, table, group_first, n_groups,
        dim_q, quads, shortlist, budget, indices.data_ptr(), valid.data_ptr(), out_keys, out_values, slots,
        max(1, threads), profile, *_pool_args(pool))
    if status != 0:
        raise MemoryError("The native selection engine could not allocate its scratch memory.")
    profiling.record(profile, batch * kv_heads, time.thread_time_ns() - started if profile is not None else 0)
    return indices, valid


__all__ = ["GROUP", "CarriedPool", "Chunks", "IndexView", "chunks", "select"]
