"""Regroup sequences of dual caches into one new cache: how a continuous batch adds and drops rows between decode
steps (`serving/batch.py`) and how a finished request's sequence leaves the batch as a session of its own.

A `DualDecoderCache` keeps its sequences on one position axis (a left-padded batch). `regroup` builds a new cache
whose rows are the chosen sequences of caches between requests, right-aligned on an axis as long as the longest of
them: each sequence keeps its own tokens, pads (never selected, never attended) fill the left of the shorter ones,
and the leading pads of its old batch are dropped. What a sequence's next decode step sees is unchanged: its keys and
values (RoPE was applied with its own positions, which the decode loop keeps per row), its sink tokens, its window,
its selector index (built per sequence from its first real token, so the same groups as before), and what each
layer's last request carries to the next (`RequestCarry`: the query that selects its next entries, the positions last
attended, its resident set, restored from the host store at its next step; handed to the new layer whole,
`DualLayer.adopt`). So a sequence decodes in the new cache as it would have in the old one, token for token at any
budget with the exact and lowbit selectors (the Quest baseline's pages are aligned to axis positions and may differ).
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

from ..layer.layer import DualLayer
from ..layer.request import RequestCarry
from ..model.layer_types import SLIDING_ATTENTION
from ..selection.selectors.base import OWN_TOP
from .cache import DualDecoderCache


def _check(rows: Sequence[tuple[DualDecoderCache, int]]) -> None:
    if not rows:
        raise ValueError("regroup() needs at least one (cache, row) pair.")
    first = rows[0][0]
    for cache, row in rows:
        if not isinstance(cache, DualDecoderCache):
            raise TypeError(f"regroup() takes (DualDecoderCache, row) pairs, got a {type(cache).__name__}.")
        if cache.closed:
            raise RuntimeError("regroup() was given a closed DualDecoderCache.")
        if cache.request_running:
            raise RuntimeError("regroup() needs caches between requests: end the running request first "
                               "(DualDecoderCache.end_request).")
        if cache.get_seq_length() == 0:
            raise ValueError("regroup() was given a DualDecoderCache that holds no tokens.")
        if cache.sequences.first_real is None:
            raise ValueError("regroup() was given a DualDecoderCache whose prompt has no sink yet; end its request "
                             "first (DualDecoderCache.end_request).")
        held = cache.sequences.first_real.shape[0]
        if not 0 <= row < held:
            raise ValueError(f"Row {row} is out of range for a DualDecoderCache of {held} sequence(s).")
        if cache.dual_config != first.dual_config:
            raise ValueError("regroup() needs caches with one DualDecoderConfig.")
        if (cache.kv_heads, cache.head_dim, len(cache.layers)) != (first.kv_heads, first.head_dim, len(first.layers)):
            raise ValueError("regroup() needs caches of one model.")


def _layer_types(rows: Sequence[tuple[DualDecoderCache, int]]) -> list[str]:
    """Per layer: sliding when any source serves it sliding, else full attention. A sliding-window layer served as
    full attention (a request shorter than the window, `DualDecoderCache.fit_layers`) holds every stored token, so
    its window can always be taken from its host store; the reverse is not possible (a sliding layer has dropped
    what fell out of its window), and sliding is exact for every sequence."""
    types = [list(cache.layer_types) for cache, _ in rows]
    return [SLIDING_ATTENTION if SLIDING_ATTENTION in column else column[0] for column in zip(*types)]


def regroup(rows: Sequence[tuple[DualDecoderCache, int]]) -> DualDecoderCache:
    """A new `DualDecoderCache` holding sequence `row` of each `(cache, row)` pair, in that order.

    The source caches are left as they are (the caller closes those it no longer needs); a cache may appear in
    several pairs.

    Args:
        rows: `(cache, row)` pairs: caches of one model and one `DualDecoderConfig`, between requests (no request
            running), holding at least one token each. A layer that some of them serve sliding and others as full
            attention (a sliding window longer than their requests) is sliding in the new cache.

    Returns:
        An open cache of `len(rows)` sequences on an axis of `max(tokens of each sequence)` positions, between
        requests: a decode loop continues it with `begin_request(..., input_tokens=axis)` and `end_prefill()`
        (no prefill: the sequences' next queries select their first step's entries).

    Raises:
        ValueError / TypeError / RuntimeError: for pairs that do not fit (before anything is allocated).
        HostMemoryError: when the new cache's host stores would pass the host-memory limit (before allocating).
    """
    _check(rows)
    first = rows[0][0]
    starts = [int(cache.sequences.first_real[row]) for cache, row in rows]  # first real position of each
    lengths = [cache.get_seq_length() - start for (cache, _), start in zip(rows, starts)]
    axis, batch = max(lengths), len(rows)
    offsets = [axis - length for length in lengths]

    out = DualDecoderCache(first.text_config, dual_config=first.dual_config)
    out.use_shard(first.shard)  # under tensor parallelism: the KV heads of this rank
    out.layers = out.layers_of_types(_layer_types(rows))
    dtype = _kv_dtype(first)
    out.host_memory.check(out.host_bytes_needed(batch, axis, dtype, prompt_tokens=axis),
                          f"{batch} regrouped sequence(s) of {axis} positions")

    valid = torch.zeros(batch, axis, dtype=torch.bool)
    token_ids = torch.zeros(batch, axis, dtype=torch.long)
    for i, ((cache, row), start, offset) in enumerate(zip(rows, starts, offsets)):
        positions = torch.arange(start, cache.get_seq_length())[None, :]
        valid[i, offset:] = cache.sequences.is_real(positions)[row if cache.sequences.valid is not None and
                                                               cache.sequences.valid.shape[0] > 1 else 0]
        if cache.token_ids is not None and cache.token_ids.shape[1] >= cache.get_seq_length():
            token_ids[i, offset:] = cache.token_ids[row if cache.token_ids.shape[0] > 1 else 0, start:]
    out.sequences.set_prompt(valid, batch, axis)
    out.sequences.finish_prompt(batch, axis)
    out.token_ids = token_ids if all(c.token_ids is not None for c, _ in rows) else None

    try:
        for layer_idx, layer in enumerate(out.layers):
            sources = [(cache.layers[layer_idx], row) for cache, row in rows]
            if isinstance(layer, DualLayer):
                _regroup_dual(layer, sources, starts, offsets, axis, out)
            else:
                _regroup_sliding(layer, sources, lengths, axis)
    except BaseException:
        out.close()
        raise
    return out


def _kv_dtype(cache: DualDecoderCache) -> torch.dtype:
    """The K/V dtype `cache` stores."""
    for layer in cache.layers:
        if isinstance(layer, DualLayer) and layer.host is not None:
            return layer.host.dtype
        if not isinstance(layer, DualLayer) and layer.is_initialized:
            return layer.keys.dtype
    raise ValueError("regroup() was given a DualDecoderCache that holds no tokens.")


def _regroup_dual(layer: DualLayer, sources, starts, offsets, axis: int, out: DualDecoderCache) -> None:
    """Host store, carry and selector index of one full-attention layer."""
    src = sources[0][0]
    kv_heads, dim = src.host.shape_prefix[1], src.host.head_dim
    keys = torch.zeros(len(sources), kv_heads, axis, dim, dtype=src.host.dtype)
    values = torch.zeros_like(keys)
    for i, ((source, row), start, offset) in enumerate(zip(sources, starts, offsets)):
        source.host.wait_written()
        end, rows = source.host.length, slice(row, row + 1)
        _copy_positions(source.host.key_chunks(end, rows), start, keys[i, :, offset:])
        _copy_positions(source.host.value_chunks(end, rows), start, values[i, :, offset:])
    carry = RequestCarry(_carried_queries(sources), _carried_attended(sources, starts, offsets),
                         _carried_resident(sources, starts, offsets), src.carry.scaling)
    layer.adopt(keys, values, src.device, carry)
    if layer.selector is not None:
        layer.selector.adopt([(source.selector, row) for source, row in sources], axis, out.sequences.first_real)


def _carried_queries(sources) -> torch.Tensor | None:
    """The query that selects each row's next first step, stacked (None unless every source carries one)."""
    queries = [source.carry.query for source, _ in sources]
    if not all(q is not None for q in queries):
        return None
    return torch.stack([q[row if q.shape[0] > 1 else 0] for q, (_, row) in zip(queries, sources)])


def _carried_attended(sources, starts, offsets) -> torch.Tensor | None:
    """The positions each row's last step attended, on the new axis (None when no source carries any)."""
    attended = [source.carry.attended for source, _ in sources]
    if all(a is None for a in attended):
        return None
    kv_heads = sources[0][0].host.shape_prefix[1]
    width = max(a.shape[2] for a in attended if a is not None)
    rows = []
    for a, (_, row), start, offset in zip(attended, sources, starts, offsets):
        mine = None if a is None else a[row if a.shape[0] > 1 else 0]
        if mine is None or int(mine[0, 0]) == OWN_TOP:  # not decoded yet: its first step continues its own
            rows.append(torch.full((kv_heads, width), OWN_TOP, dtype=torch.long))  # query's top entries
            continue
        shifted = torch.where(mine >= start, mine - start + offset, -1)
        rows.append(torch.nn.functional.pad(shifted, (0, width - mine.shape[1]), value=-1))
    return torch.stack(rows)


def _carried_resident(sources, starts, offsets) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each row's resident set (positions, stamps), on the new axis, restored at its next step (None when no source
    carries one)."""
    carried = [source.carry.resident for source, _ in sources]
    if all(c is None for c in carried):
        return None
    kv_heads = sources[0][0].host.shape_prefix[1]
    width = max(c[0].shape[2] for c in carried if c is not None)
    positions, stamps = [], []
    for c, (_, row), start, offset in zip(carried, sources, starts, offsets):
        if c is None:  # not decoded yet: its first step starts from an empty set
            positions.append(torch.full((kv_heads, width), -1, dtype=torch.long))
            stamps.append(torch.zeros(kv_heads, width, dtype=torch.long))
            continue
        mine, when = c[0][row if c[0].shape[0] > 1 else 0], c[1][row if c[1].shape[0] > 1 else 0]
        shifted = torch.where(mine >= start, mine - start + offset, -1)
        positions.append(torch.nn.functional.pad(shifted, (0, width - mine.shape[1]), value=-1))
        stamps.append(torch.nn.functional.pad(when, (0, width - when.shape[1]), value=0))
    return torch.stack(positions), torch.stack(stamps)


def _copy_positions(chunks: list[torch.Tensor], start: int, out: torch.Tensor) -> None:
    """Copy positions `[start, ...)` of one sequence from a host store's chunk views (`(1, H_kv, n_i, D)` each,
    consecutive positions from 0) into `out` (`(H_kv, positions, D)`), chunk by chunk, with no intermediate copy."""
    first = 0  # the chunk's first position
    for chunk in chunks:
        last = first + chunk.shape[2]
        if last > start:
            lo = max(start, first)
            out[:, lo - start:last - start] = chunk[0, :, lo - first:]
        first = last


def _regroup_sliding(layer: DynamicSlidingWindowLayer, sources, lengths, axis: int) -> None:
    """Window of one sliding-window layer: each sequence's last tokens, right-aligned (zeros where it has fewer),
    from a sliding source's window or from the host store of a source that served the layer as full attention."""
    window = layer.sliding_window
    kept = window - 1 if axis >= window else axis  # what DynamicSlidingWindowLayer keeps after a crop
    tails = [_tail(source, row, min(kept, length)) for (source, row), length in zip(sources, lengths)]
    like = next(keys for keys, _ in tails if keys is not None)
    shape = (len(sources), like.shape[1], kept, like.shape[3])
    keys = torch.zeros(shape, dtype=like.dtype, device=like.device)
    values = torch.zeros_like(keys)
    for i, (tail_keys, tail_values) in enumerate(tails):
        if tail_keys is not None:
            take = tail_keys.shape[2]
            keys[i, :, kept - take:] = tail_keys[0].to(keys.device)
            values[i, :, kept - take:] = tail_values[0].to(keys.device)
    layer.lazy_initialization(keys[:, :, :0], values[:, :, :0])
    layer.keys, layer.values = keys, values
    layer.cumulative_length = axis


def _tail(source, row: int, take: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """`(1, H_kv, take, D)` keys and values of one sequence's last `take` positions, on the layer's device (None
    when the layer holds nothing)."""
    if isinstance(source, DualLayer):
        if source.host is None:
            return None, None
        source.host.wait_written()
        end = source.host.length
        keys, values = source.host.read(end - take, end)
        at = row if keys.shape[0] > 1 else 0
        return keys[at : at + 1].to(source.device), values[at : at + 1].to(source.device)
    if not source.is_initialized or source.keys is None:
        return None, None
    n = source.keys.shape[2]
    return source.keys[row : row + 1, :, n - take:], source.values[row : row + 1, :, n - take:]
