"""The running batch with transformers' default `DynamicCache` rows (the benchmark's `dense` system): the same
continuous batching as `batch.DualBatch`, with every K/V on the device and one token per decode step.

Rows join and leave by rebuilding the `DynamicCache`: each row's keys and values right-aligned on one axis, zeros on
the left of the shorter ones, masked by the attention mask (a left-padded batch, as `generate()` pads one).
"""

from __future__ import annotations

from typing import Callable

import torch
from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

from ..model.inputs import cache_kwarg_name
from .rows import Row


class DenseBatch:
    """Rows decoding together on one `DynamicCache`; requests prefilled one chunk at a time on caches of their own.

    Args:
        model: the causal LM. pad_id: token of no row (unused positions). eos_ids: end-of-sequence ids.
        decode: token ids → text, for stop strings; None without a tokenizer.
    """

    prefill_chunk_size = 512  # tokens per prefill call

    def __init__(self, model, pad_id: int, eos_ids: set[int], decode: Callable[[list[int]], str] | None) -> None:
        self.model, self.pad_id, self.eos_ids, self.decode = model, pad_id, eos_ids, decode
        self.device = next(model.parameters()).device
        self.cache_arg = cache_kwarg_name(model)
        self.cache: DynamicCache | None = None
        self.rows: list[Row] = []
        self.mask: torch.Tensor | None = None
        self.spec_hits = self.spec_steps = 0  # no speculation

    def _forward(self, cache: DynamicCache, tokens, mask, positions, keep: int = 1):
        return self.model(input_ids=tokens.to(self.device), attention_mask=None if mask is None else
                          mask.to(self.device), position_ids=positions.to(self.device),
                          use_cache=True, logits_to_keep=keep, **{self.cache_arg: cache})

    def prefill_chunk(self, row: Row) -> str:
        """Feed the row's next prompt chunk; after the last one pick and stream its first token. Returns "more" or
        "done" (as `DualBatch.prefill_chunk`)."""
        if row.cache is None:
            row.cache = DynamicCache(config=self.model.config)
        prompt, start = row.handle.prompt, row.prefilled
        end = min(start + row.prefill_tokens(self.prefill_chunk_size), row.prompt_len)
        with torch.inference_mode():
            outputs = self._forward(row.cache, prompt[None, start:end], None, torch.arange(start, end)[None],
                                    0 if row.wants_prompt_logits else 1)  # 0: every position's (echo, logprobs)
            if row.wants_prompt_logits:
                row.take_prompt_logits(outputs.logits[0], start)
        row.prefilled = end
        if end < row.prompt_len:
            return "more"
        row.emit(row.pick(outputs.logits[0, -1].to("cpu", torch.float32)), self.decode, self.eos_ids)
        return "done"

    def regroup(self, joining: list[Row]) -> tuple[list[tuple[Row, None]], list[tuple[Row, str]]]:
        """Rows that finished leave, `joining` rows join: the batch's `DynamicCache` is rebuilt from the rows that
        stay and the joining rows' own caches. Returns `(row, None)` for each row that left, and no failed rows
        (as `DualBatch.regroup`; a failure here raises and loses the batch)."""
        staying = [(self.cache, i, row) for i, row in enumerate(self.rows) if not row.done]
        left = [(row, None) for row in self.rows if row.done]
        sources = staying + [(row.cache, 0, row) for row in joining]
        self.rows = [row for _, _, row in sources]
        for row in joining:
            row.cache = None
        if not sources:
            self.cache, self.mask = None, None
            return left, []
        lengths = [row.length - 1 for row in self.rows]  # fed tokens, right-aligned in their caches
        axis = max(lengths)
        cache = DynamicCache(config=self.model.config)
        for layer_idx, layer in enumerate(cache.layers):
            parts = [(source.layers[layer_idx], i) for source, i, _ in sources]
            kept = axis
            if isinstance(layer, DynamicSlidingWindowLayer):
                kept = layer.sliding_window - 1 if axis >= layer.sliding_window else axis
            first = parts[0][0]
            keys = first.keys.new_zeros(len(parts), first.keys.shape[1], kept, first.keys.shape[3])
            values = first.values.new_zeros(len(parts), first.values.shape[1], kept, first.values.shape[3])
            for b, ((source, i), length) in enumerate(zip(parts, lengths)):
                take = min(kept, length)
                keys[b, :, kept - take:] = source.keys[i, :, source.keys.shape[2] - take:]
                values[b, :, kept - take:] = source.values[i, :, source.values.shape[2] - take:]
            layer.lazy_initialization(keys[:, :, :0], values[:, :, :0])
            layer.keys, layer.values = keys, values
            if isinstance(layer, DynamicSlidingWindowLayer):
                layer.cumulative_length = axis
        self.cache = cache
        self.mask = torch.zeros(len(self.rows), axis, dtype=torch.long)
        for b, length in enumerate(lengths):
            self.mask[b, axis - length:] = 1
        return left, []

    def step(self) -> None:
        """One decode step of every row (one token each), then pick, stream and stop-check each live row's token."""
        rows = self.rows
        tokens = torch.tensor([row.pending if not row.done else self.pad_id for row in rows])[:, None]
        positions = torch.tensor([row.length - 1 for row in rows])[:, None]
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(rows), 1)], dim=1)
        with torch.inference_mode():
            logits = self._forward(self.cache, tokens, self.mask, positions).logits[:, -1].to("cpu", torch.float32)
        for i, row in enumerate(rows):
            if not row.done:
                row.emit(row.pick(logits[i]), self.decode, self.eos_ids)

    def memory(self, caches: list) -> dict[str, int]:
        """Device bytes of the K/V held now by the batch's cache and `caches`; no host bytes."""
        device = 0
        for cache in [self.cache, *caches]:
            if cache is not None:
                device += sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers
                              if layer.is_initialized and layer.keys is not None)
        return {"device_bytes": device, "host_bytes": 0}

    def close(self) -> None:
        """Drop the batch's cache (its rows are the caller's to finish)."""
        self.cache, self.rows, self.mask = None, [], None
