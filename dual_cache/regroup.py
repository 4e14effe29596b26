"""Regroup sequences of dual caches into one new cache: how a continuous batch adds and drops rows between decode
steps (`serving/batch.py`) and how a finished request's sequence leaves the batch as a session of its own.

A `DualDecoderCache` keeps its sequences on one position axis (a left-padded batch). `regroup` builds a new cache
whose rows are the chosen sequences of caches between requests, right-aligned on an axis as long as the longest of
them: each sequence keeps its own tokens, pads (never selected, never attended) fill the left of the shorter ones,
and the leading pads of its old batch are dropped. What a sequence's next decode step sees is unchanged: its keys and
values (RoPE was applied with its own positions, which the decode loop keeps per row), its sink tokens, its window,
its selector index (built per sequence from its first real token, so the same groups as before), and the query
that selects its next entries (`DualLayer.next_query`). So a sequence decodes in the new cache as it would have in
the old one, token for token at any budget with the exact and lowbit selectors (the Quest baseline's pages are
aligned to axis positions and may differ).
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

from .cache import DualDecoderCache
from .layer import DualLayer


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
        if cache.get_seq_length() == 0 or not cache.dual_layers or cache.dual_layers[0].host is None:
            raise ValueError("regroup() was given a DualDecoderCache that holds no tokens.")
        if cache.sequences.first_real is None:
            raise ValueError("regroup() was given a DualDecoderCache whose prompt has no sink yet; end its request "
                             "first (DualDecoderCache.end_request).")
        held = cache.dual_layers[0].host.shape_prefix[0]
        if not 0 <= row < held:
            raise ValueError(f"Row {row} is out of range for a DualDecoderCache of {held} sequence(s).")
        if cache.dual_config != first.dual_config or cache.layer_types != first.layer_types:
            raise ValueError("regroup() needs caches with one DualDecoderConfig and the same layer types (sliding "
                             "windows served as full attention or not: `DualDecoderCache.fit_layers`).")
        if (cache.kv_heads, cache.head_dim, len(cache.layers)) != (first.kv_heads, first.head_dim, len(first.layers)):
            raise ValueError("regroup() needs caches of one model.")


def regroup(rows: Sequence[tuple[DualDecoderCache, int]]) -> DualDecoderCache:
    """A new `DualDecoderCache` holding sequence `row` of each `(cache, row)` pair, in that order.

    The source caches are left as they are (the caller closes those it no longer needs); a cache may appear in
    several pairs.

    Args:
        rows: `(cache, row)` pairs: caches of one model and one `DualDecoderConfig`, with the same layer types,
            between requests (no request running), holding at least one token each.

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
    out.layers = out.layers_of_types(first.layer_types)
    source_layer = first.dual_layers[0]
    dtype = source_layer.host.dtype
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


def _regroup_dual(layer: DualLayer, sources, starts, offsets, axis: int, out: DualDecoderCache) -> None:
    """Host store, selector index and next query of one full-attention layer."""
    src = sources[0][0]
    kv_heads, dim = src.host.shape_prefix[1], src.host.head_dim
    keys = torch.zeros(len(sources), kv_heads, axis, dim, dtype=src.host.dtype)
    values = torch.zeros_like(keys)
    for i, ((source, row), start, offset) in enumerate(zip(sources, starts, offsets)):
        source.host.wait_written()
        end, rows = source.host.length, slice(row, row + 1)
        _copy_positions(source.host.key_chunks(end, rows), start, keys[i, :, offset:])
        _copy_positions(source.host.value_chunks(end, rows), start, values[i, :, offset:])
    layer.reserve_tokens = axis
    layer.lazy_initialization(keys[:, :, :0].to(src.device), values[:, :, :0].to(src.device))
    layer.host.append(keys, values)
    layer.scaling = src.scaling
    queries = [source.next_query for source, _ in sources]
    if all(q is not None for q in queries):
        layer.next_query = torch.stack([q[row if q.shape[0] > 1 else 0] for q, (_, row) in zip(queries, sources)])
    if layer.selector is not None:
        layer.selector.adopt([(source.selector, row) for source, row in sources], axis, out.sequences.first_real)


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
    """Window of one sliding-window layer: each sequence's last tokens, right-aligned (zeros where it has fewer)."""
    src = sources[0][0]
    window = src.sliding_window
    kept = window - 1 if axis >= window else axis  # what DynamicSlidingWindowLayer keeps after a crop
    shape = (len(sources), src.keys.shape[1], kept, src.keys.shape[3])
    keys = torch.zeros(shape, dtype=src.keys.dtype, device=src.keys.device)
    values = torch.zeros_like(keys)
    for i, ((source, row), length) in enumerate(zip(sources, lengths)):
        take = min(kept, length)
        if take:
            keys[i, :, kept - take:] = source.keys[row, :, source.keys.shape[2] - take:]
            values[i, :, kept - take:] = source.values[row, :, source.values.shape[2] - take:]
    layer.lazy_initialization(keys[:, :, :0], values[:, :, :0])
    layer.keys, layer.values = keys, values
    layer.cumulative_length = axis

