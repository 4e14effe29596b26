"""Prefill once, decode every method: one sample's prompt is prefilled once and each method continues its own copy.

`SharedPrefill(model, input_ids, max_new_tokens)` runs the model over every prompt token but the last, once, into a
`DynamicCache(config=model.config)` (the cache `generate()` builds: sliding-window layers keep their window), in
chunks of `chunk` tokens: with an explicit mask the CPU attention computes every query-key pair of a pass, so
passes of 2K tokens do about half the full-attention work of one pass over the prompt, and a sliding-window layer
attends over its window plus the pass instead of the whole prompt (Gemma-3-270M at 16K: 224 s instead of 440 s
with one thread, one run each on the loaded 2-core machine).
`cache_for(method)` then gives one method a cache of its own holding those positions:

- dense: a new `DynamicCache(config=model.config)` filled layer by layer through `update()`;
- a dual configuration: a fresh `DualDecoderCache` whose first request stores the positions through the cache's
  public request API (`begin_request`, `update` per layer, `crop(0)`, `end_request` with the prefix's token ids),
  sized for the whole generation as `generate(cache_implementation="dual")` sizes it.

A sliding-window layer of the prefix holds only its window, so it is handed on left-padded with zeros to the
prefix's length: the receiving sliding-window layer counts every position and keeps the window, never the zeros.

The method's `generate()` is then called with the whole prompt and that cache: it prefills the last prompt token
only, whose queries select the first decode step (dual) exactly as a stand-alone run's last prompt position does,
and decodes. So a method costs its decode (and a copy of the prefix), not a prefill. The arithmetic is the
stand-alone run's: the keys and values of the prefix come from a forward over the same positions (split differently
into passes, so they agree to rounding), and `tests/test_shared_prefill.py` checks that each method generates exactly
the tokens of its own stand-alone run.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import DynamicCache

from dual_cache.cache.cache import DualDecoderCache
from dual_cache.cache.checks import check_model_serves_dual
from dual_cache.config import DualDecoderConfig
from dual_cache.layer.layer import DualLayer
from dual_cache.model.inputs import cache_kwarg_name

from .methods import Method


class SharedPrefill:
    """The prompt of one sample but its last token, prefilled once; a cache of its own per method.

    Args:
        model: a transformers causal LM (eval mode).
        input_ids: the prompt's token ids (one sequence, at least 2 tokens).
        max_new_tokens: the most tokens each method will generate (sizes the dual caches as `generate()` does).
        chunk: prompt tokens per prefill forward.

    Attributes:
        seconds: wall time of the shared prefill.
        prefix_tokens: tokens prefilled (`len(input_ids) - 1`).

    Raises:
        ValueError: a prompt of fewer than 2 tokens, or non-positive `max_new_tokens` / `chunk`.
    """

    def __init__(self, model, input_ids: list[int], max_new_tokens: int, chunk: int = 2048) -> None:
        if len(input_ids) < 2:
            raise ValueError(f"a shared prefill needs a prompt of at least 2 tokens, got {len(input_ids)}.")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}.")
        self.model = model
        self.ids = torch.tensor([input_ids], device=model.device)
        self.prefix_tokens = len(input_ids) - 1
        self.max_new_tokens = max_new_tokens
        self.cache_arg = cache_kwarg_name(model)
        self.prefix: DynamicCache | None = DynamicCache(config=model.config)
        start = time.perf_counter()
        with torch.inference_mode():
            for lo in range(0, self.prefix_tokens, chunk):
                hi = min(lo + chunk, self.prefix_tokens)
                model(input_ids=self.ids[:, lo:hi], position_ids=torch.arange(lo, hi, device=model.device)[None],
                      use_cache=True, logits_to_keep=1, **{self.cache_arg: self.prefix})
        self.seconds = time.perf_counter() - start

    def _layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's `(keys, values)` over the whole prefix; a sliding-window layer's window left-padded with
        zeros (positions no later step attends to)."""
        if self.prefix is None:
            raise RuntimeError("this SharedPrefill was closed.")
        out = []
        for layer in self.prefix.layers:
            keys, values = layer.keys, layer.values
            missing = self.prefix_tokens - keys.shape[2]
            if missing:
                pad = (0, 0, missing, 0)
                keys, values = torch.nn.functional.pad(keys, pad), torch.nn.functional.pad(values, pad)
            out.append((keys, values))
        return out

    def _windowed(self) -> list[bool]:
        """Per layer: whether the prefix holds only a window of it."""
        return [layer.keys.shape[2] < self.prefix_tokens for layer in self.prefix.layers]

    def cache_for(self, method: Method) -> Any:
        """A new cache holding the prefix for `method`: a `DynamicCache` for dense (`cache_config` None), a
        `DualDecoderCache` with the method's `cache_config` otherwise. The caller passes it to `generate()` with the
        whole prompt and closes a dual one afterwards.

        Raises:
            ValueError: the method's configuration is invalid or the model cannot be served by the dual cache.
        """
        if method.cache_config is None:
            return self.dense_cache()
        return self.dual_cache(method.cache_config)

    def dense_cache(self) -> DynamicCache:
        """A `DynamicCache(config=model.config)` holding the prefix (its own tensors)."""
        cache = DynamicCache(config=self.model.config)
        with torch.inference_mode():
            for layer_idx, (keys, values) in enumerate(self._layers()):
                cache.update(keys, values, layer_idx)  # concatenates into new tensors: the prefix stays untouched
        return cache

    def dual_cache(self, options: dict[str, Any] | DualDecoderConfig) -> DualDecoderCache:
        """A `DualDecoderCache` with `options` whose first request stored the prefix (between requests, host
        memory only): `generate()` continues it with the whole prompt.

        Raises:
            ValueError: invalid options, or a model the dual cache cannot serve (`checks.check_model_serves_dual`).
            HostMemoryError: the generation would not fit in the cache's host-memory limit.
        """
        config = options if isinstance(options, DualDecoderConfig) else DualDecoderConfig.from_dict(dict(options))
        prompt = self.prefix_tokens + 1
        # as `generate(cache_implementation="dual")`: max_cache_len = max_length + 2, a request of max_length + 1
        cache = DualDecoderCache(self.model.config, dual_config=config,
                                 max_cache_len=prompt + self.max_new_tokens + 2)
        try:
            check_model_serves_dual(self.model, cache, self.cache_arg, {"input_ids": self.ids[:, -1:]})
            cache.begin_request(1, prompt + self.max_new_tokens + 1, self.model.dtype, self.model.device, None,
                                self.prefix_tokens)
            windowed = self._windowed()
            served = [i for i, layer in enumerate(cache.layers) if windowed[i] and isinstance(layer, DualLayer)]
            if served:
                raise ValueError(f"layers {served} keep a sliding window in the prefill but attend to everything in "
                                 "this dual cache; prefill with a cache of the same layer types.")
            with torch.inference_mode():
                for layer_idx, (keys, values) in enumerate(self._layers()):
                    cache.update(keys, values, layer_idx)
                cache.crop(0)  # sliding-window layers keep their window
            cache.end_request(self.ids[:, : self.prefix_tokens])
        except BaseException:
            cache.close()
            raise
        return cache

    def close(self) -> None:
        """Free the prefix (idempotent)."""
        self.prefix = None

    def __enter__(self) -> "SharedPrefill":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
