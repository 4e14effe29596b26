"""Host selection engine: one call per (layer, step) chooses the top-`budget` entries of every (sequence, KV head).

`select` runs the native engine (`selection_engine.cpp`, built and loaded by `native.py`; GIL released,
multi-threaded over sequences and KV heads, CPU features detected at run time) or, where it cannot be built, the
pure-torch reference (`reference.py`, which defines every number the engine computes). `codes.py` holds the 2-bit key
index's storage format. The engine knows nothing of transformers, caches or selectors' policies.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Sequence

import torch

from ..sync_points import uncounted
from . import native, reference
from .codes import GROUP, padded_dim

KEY_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@dataclass(frozen=True)
class IndexView:
    """The 2-bit key index of the store's sequences as the engine reads it (`codes.py`), for the `b` sequences a
    call selects for (`select`'s `rows`).

    Attributes:
        packed: `(B, H_kv, capacity, 16 · D_q)` uint8, contiguous per (sequence, KV head) (groups in order): every
            sequence of the store.
        params: `(B, H_kv, capacity, 2, D_q)` bfloat16 per-channel minimum and step of each group.
        group_first: `(b,)` int64 first position of each selected sequence's group 0.
        n_groups: `(b,)` int64 complete groups indexed per selected sequence.
    """

    packed: torch.Tensor
    params: torch.Tensor
    group_first: torch.Tensor
    n_groups: torch.Tensor

    def usable(self, end: int) -> torch.Tensor:
        """`(b,)` int64: the groups that lie wholly below `end`."""
        fit = torch.div(end - self.group_first, GROUP, rounding_mode="floor").clamp_(min=0)
        return torch.minimum(self.n_groups, fit)


def select(query: torch.Tensor, mask: torch.Tensor, keys: Sequence[torch.Tensor], budget: int, scaling: float,
           index: IndexView | None = None, shortlist: int = 0, quads: int | None = None,
           threads: int | None = None, values: Sequence[torch.Tensor] | None = None,
           out: tuple[torch.Tensor, torch.Tensor] | None = None,
           rows: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-`budget` positions per (sequence, KV head) by group attention mass, optionally among a shortlist, and
    optionally the gather of the selected keys and values into `out` in the same call.

    Without `index` every candidate is scored exactly ("exact"). With it, a scan of the 2-bit codes of `quads`
    channel quads (the rest enter at each group's midpoint) shortlists `shortlist` positions per (sequence, KV
    head); they and the candidates the index does not cover are scored exactly (`reference.py` gives the
    definitions).

    Args:
        query: `(b, H_q, D)` float32 host queries (after RoPE); `H_q` a multiple of `H_kv`.
        mask: `(b, end)` bool host, True at selectable positions.
        keys: the host store's key chunks covering positions `[0, ≥ end)` in order, each `(B or 1, H_kv, n_i, D)`
            float32 / bfloat16 / float16 with contiguous rows (a chunk of batch 1 is shared by every sequence).
        budget: positions per (sequence, KV head); scaling: the softmax scale.
        index: the sequences' 2-bit key index, or None.
        shortlist: positions the scan keeps per (sequence, KV head).
        quads: channel quads (4 channels each) the scan reads, 1 .. `padded_dim(D) / 4`; None: all of them.
        threads: host threads (default `torch.get_num_threads()`); the result does not depend on it.
        values: the value chunks matching `keys` (same shapes and dtype), to gather with `out`.
        out: `(keys_out, values_out)`, each `(b, H_kv, budget, D)` in the keys' dtype, contiguous or the first
            `budget` slots of a contiguous `(b, H_kv, S, D)` tensor (`S >= budget`): filled with the rows at the
            returned indices (an invalid slot gets position 0's rows, as `HostKVStore.gather` of the indices would).
        rows: the store's sequences (rows of the chunks and of the index) that the `b` queries belong to, in
            order; None: `0 … b - 1`. A subset costs only its own work (the repair of some sequences of a batch).

    Returns:
        `(indices, valid)`, both `(b, H_kv, budget)`: int64 positions, ascending where valid (0 elsewhere), bool.

    Raises:
        ValueError: on inconsistent shapes or dtypes (before any work).
    """
    with uncounted():  # host tensors only (the decode step's host waits are counted where they happen)
        return _select(query, mask, keys, budget, scaling, index, shortlist, quads, threads, values, out, rows)


def _select(query, mask, keys, budget, scaling, index, shortlist, quads, threads, values, out, rows):
    batch, q_heads, dim = query.shape
    rows = list(range(batch)) if rows is None else [int(r) for r in rows]
    stored = max(chunk.shape[0] for chunk in keys)
    if len(rows) != batch or any(not 0 <= r < stored for r in rows) and stored > 1:
        raise ValueError(f"select needs one store row (< {stored}) per query row, got rows {rows} for {batch} "
                         "queries.")
    kv_heads = keys[0].shape[1]
    if (values is None) != (out is None):
        raise ValueError("select gathers with both `values` and `out`, or neither.")
    if values is not None:
        _check_gather(keys, values, out, (batch, kv_heads, budget, dim))
    if query.dtype != torch.float32 or q_heads % kv_heads or mask.shape[0] != batch or mask.dtype != torch.bool:
        raise ValueError(f"select needs float32 queries (b, H_q, D) with H_q a multiple of H_kv={kv_heads} and a "
                         f"(b, end) bool mask; got query {tuple(query.shape)} {query.dtype}, mask "
                         f"{tuple(mask.shape)} {mask.dtype}.")
    if keys[0].dtype not in KEY_TYPES or any(c.shape[-1] != dim or c.stride(-1) != 1 or c.stride(-2) != dim
                                             for c in keys):
        raise ValueError(f"select needs float32/bfloat16/float16 key chunks with contiguous rows of {dim} channels.")
    end = mask.shape[1]
    if sum(c.shape[2] for c in keys) < end:
        raise ValueError(f"The key chunks hold {sum(c.shape[2] for c in keys)} positions, fewer than end={end}.")
    all_quads = padded_dim(dim) // 4
    quads = all_quads if quads is None else quads
    if isinstance(quads, bool) or not isinstance(quads, int) or not 1 <= quads <= all_quads:
        raise ValueError(f"select needs 1 <= quads <= {all_quads} (channel quads of a {dim}-channel head), got "
                         f"{quads!r}.")
    view = None
    if index is not None:
        view = (index.packed, index.params, index.group_first, index.usable(end))
    library = native.library()
    if library is None or budget == 0 or end == 0:
        picked = [chunk if chunk.shape[0] == 1 else chunk[rows] for chunk in keys]
        if view is not None:
            view = (view[0][rows], view[1][rows], view[2], view[3])
        indices, valid = reference.select(query, mask, picked, budget, scaling, view, shortlist, quads)
        if out is not None:
            reference.gather(picked, indices, out[0])
            reference.gather([chunk if chunk.shape[0] == 1 else chunk[rows] for chunk in values], indices, out[1])
        return indices, valid
    return _native_select(library, query.contiguous(), mask.contiguous(), keys, budget, scaling, view, shortlist,
                          torch.get_num_threads() if threads is None else threads, quads, values, out, rows)


def _check_gather(keys, values, out, shape) -> None:
    """ValueError unless `values` match `keys` chunk by chunk and `out` holds two contiguous `shape` tensors of the
    keys' dtype."""
    if len(values) != len(keys) or any(v.shape != k.shape or v.dtype != k.dtype or v.stride(-1) != 1
                                       or v.stride(-2) != v.shape[-1] for k, v in zip(keys, values)):
        raise ValueError("select's `values` must match `keys` chunk by chunk (shapes, dtype, contiguous rows).")
    if len(out) != 2 or any(o.shape != shape or o.dtype != keys[0].dtype or out_slots(o) is None
                            or o.device.type != "cpu" for o in out) or out_slots(out[0]) != out_slots(out[1]):
        raise ValueError(f"select's `out` must be two host tensors of shape {shape} and dtype {keys[0].dtype}, "
                         "contiguous or the leading slots of contiguous (b, H_kv, S, D) tensors alike.")


def out_slots(out: torch.Tensor) -> int | None:
    """Rows per (sequence, KV head) of the contiguous tensor `out` `(b, H_kv, k, D)` is the first `k` slots of (its
    own `k` when contiguous), or None when it is not laid out that way."""
    batch, kv_heads, _, dim = out.shape
    slots = out.stride(1) // dim if dim else 0
    if out.stride(-1) != 1 or out.stride(-2) != dim or out.stride(1) != slots * dim or slots < out.shape[2] \
            or (batch > 1 and out.stride(0) != kv_heads * slots * dim):
        return None
    return slots


def _int64s(values: list[int]):
    """A ctypes int64 array of `values` (cheaper per call than building small torch tensors)."""
    return (ctypes.c_int64 * len(values))(*values)


def _segment_rows(chunks, rows: list[int], kv_heads: int) -> list[list[int]]:
    """Per chunk, the address of each selected (sequence, KV head)'s first row (a chunk of batch 1 serves every
    sequence); `rows` are the store's sequences."""
    element = chunks[0].element_size()
    addresses = []
    for chunk in chunks:
        base, s0, s1 = chunk.data_ptr(), chunk.stride(0) * element, chunk.stride(1) * element
        shared = chunk.shape[0] == 1
        addresses.append([base + (0 if shared else r * s0) + h * s1 for r in rows for h in range(kv_heads)])
    return addresses


def _native_select(library, query, mask, keys, budget, scaling, view, shortlist, threads, quads=None, values=None,
                   out=None, rows=None):
    batch, q_heads, dim = query.shape
    kv_heads = keys[0].shape[1]
    starts, lengths = [], []
    start = 0
    for chunk in keys:
        starts.append(start)
        lengths.append(chunk.shape[2])
        start += chunk.shape[2]
    rows = list(range(batch)) if rows is None else rows
    tasks = range(batch * kv_heads)
    addresses = _segment_rows(keys, rows, kv_heads)
    seg_ptr = _int64s([row[task] for task in tasks for row in addresses])  # (b·H_kv, chunks)
    value_ptr = out_keys = out_values = None
    slots = budget
    if values is not None:
        slots = out_slots(out[0])
        value_rows = _segment_rows(values, rows, kv_heads)
        value_ptr = _int64s([row[task] for task in tasks for row in value_rows])
        out_keys, out_values = out[0].data_ptr(), out[1].data_ptr()
    indices = torch.empty(batch, kv_heads, budget, dtype=torch.long)
    valid = torch.empty(batch, kv_heads, budget, dtype=torch.bool)
    codes_ptr = params_ptr = group_first = n_groups = None
    dim_q = padded_dim(dim)
    quads = dim_q // 4 if quads is None else quads
    if view is not None:
        packed, params, first, groups = view
        if not (packed.is_contiguous() and params.is_contiguous()):
            raise ValueError("The index's packed codes and parameters must be contiguous tensors.")
        codes_ptr = _int64s([packed.data_ptr() + r * packed.stride(0) + h * packed.stride(1)
                             for r in rows for h in range(kv_heads)])
        params_ptr = _int64s([params.data_ptr() + (r * params.stride(0) + h * params.stride(1)) * 2
                              for r in rows for h in range(kv_heads)])
        group_first, n_groups = _int64s(first.tolist()), _int64s(groups.tolist())
    status = library.dc_select(
        batch, kv_heads, q_heads // kv_heads, dim, KEY_TYPES[keys[0].dtype], query.data_ptr(), scaling,
        mask.shape[1], mask.data_ptr(), len(keys), _int64s(starts), _int64s(lengths), seg_ptr, codes_ptr,
        params_ptr, group_first, n_groups, dim_q, quads, shortlist, budget, indices.data_ptr(), valid.data_ptr(),
        value_ptr, out_keys, out_values, slots, max(1, threads))
    if status != 0:
        raise MemoryError("The native selection engine could not allocate its scratch memory.")
    return indices, valid


__all__ = ["GROUP", "IndexView", "select"]
