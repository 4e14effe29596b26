"""One `generate()` call for one method (greedy, or sampled from a given seed), returning the text and the cache's
device bytes."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from dual_cache.model.inputs import cache_kwarg_name

from .methods import Method
from .sampling import Sampling


@dataclass
class Generation:
    """Result of one call: `text` (decoded new tokens, special tokens dropped, not stripped: LongBench scores the
    raw decode, e.g. a code line's indentation), `new_ids`, the cache's
    `device_bytes` (dual: `cache.stats()["device_bytes"]`; dense: the `DynamicCache`'s K/V tensor bytes at the end),
    `output` (the `generate` output object), wall `seconds`, and for a dual cache `speculation`: `spec_hits`,
    `spec_steps`, `repairs` and `drift_repairs` of its `stats()` (None for other caches)."""

    text: str
    new_ids: list[int]
    device_bytes: int | None
    output: object
    seconds: float
    speculation: dict | None = None


def output_cache(output):
    """The cache object held by a `generate(return_dict_in_generate=True)` output (either field name)."""
    return getattr(output, "cache", None) or getattr(output, "past_key_values", None)


def cache_device_bytes(cache) -> int | None:
    """Device bytes of a finished cache: `stats()["device_bytes"]` when it has stats (dual), else the sum of its
    layers' key/value tensor bytes (`DynamicCache`); None when unknown."""
    if cache is None:
        return None
    if hasattr(cache, "stats"):
        return int(cache.stats()["device_bytes"])
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor):
                total += tensor.nbytes
    return total


def speculation_stats(cache) -> dict | None:
    """`spec_hits`, `spec_steps`, `repairs`, `drift_repairs` of a dual cache's `stats()`; None for other caches."""
    if cache is None or not hasattr(cache, "stats"):
        return None
    stats = cache.stats()
    return {k: int(stats[k]) for k in ("spec_hits", "spec_steps", "repairs", "drift_repairs") if k in stats}


GREEDY = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}


def generate(model, tokenizer, input_ids: list[int], method: Method, max_new_tokens: int, cache=None,
             sampling: Sampling | None = None, seed: int | None = None, **kwargs) -> Generation:
    """Generation of at most `max_new_tokens` after the prompt `input_ids` (one sequence) with `method`: greedy, or
    sampled with `sampling`'s settings after `torch.manual_seed(seed)` (the global generator, seeded just before
    `model.generate`, so calls with the same seed draw the same random numbers; `sampling.torch_seed` derives it).

    `cache`: a cache built for `method` that already holds a prefix of the prompt (`shared_prefill.SharedPrefill`);
    only the rest of the prompt is prefilled, and a dual cache is closed when the call ends. None: `method`'s own
    fresh cache. Extra `kwargs` go to `model.generate` (e.g. `logits_processor`, `output_logits`, `min_new_tokens`).

    Raises:
        ValueError: empty prompt, non-positive `max_new_tokens`, or `sampling` without a `seed`; RuntimeError: the
            method cannot run here (`method.skip_reason`).
    """
    if not input_ids:
        raise ValueError("empty prompt.")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
    if sampling is not None and seed is None:
        raise ValueError("sampled generation needs a seed (sampling.torch_seed(input_ids, sample_seed)).")
    if method.skip_reason:
        raise RuntimeError(f"{method.label} cannot run: {method.skip_reason}")
    ids = torch.tensor([input_ids], device=model.device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    selected = method.generate_kwargs() if cache is None else {cache_kwarg_name(model): cache}
    decoding = GREEDY if sampling is None else sampling.generate_kwargs()
    start = time.perf_counter()
    try:
        if sampling is not None:
            torch.manual_seed(seed)
        with torch.inference_mode():
            output = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                return_dict_in_generate=True, pad_token_id=pad, **decoding, **selected, **kwargs,
            )
        seconds = time.perf_counter() - start
        new_ids = output.sequences[0, ids.shape[1]:].tolist()
        text = tokenizer.decode(new_ids, skip_special_tokens=True)
        used = output_cache(output)
        return Generation(text, new_ids, cache_device_bytes(used), output, seconds, speculation_stats(used))
    finally:
        if cache is not None and hasattr(cache, "close"):
            cache.close()  # a dual cache given for this call: its stats stay readable
