"""Checks, before any work, that a model can be served by the dual cache.

The dual cache reaches a layer's attention through two channels: the cache object (`cache.update()`, called by
the attention module) and the `dual_cache` keyword argument of `model(...)`, which transformers passes down to the
attention function (`routing.py`). Some models drop one of them on the way (e.g. a decoder layer that calls its
attention module without `**kwargs`), and would then silently attend densely, or fail mid-generation. So the first
dual `generate()` on a model runs a one-token probe forward (uncompiled, with a throwaway `DynamicCache`, the model's
own attention) and checks that every layer the dual cache serves received both; the verdict is remembered per model
and attention implementation.
"""

from __future__ import annotations

import threading
import weakref

import torch
from transformers import DynamicCache

from .cache import DualDecoderCache
from .layer import DualLayer
from .refusals import refuse
from .routing import SUPPORTED_IMPLEMENTATIONS, AttentionProbe

_verified: "weakref.WeakKeyDictionary[torch.nn.Module, set]" = weakref.WeakKeyDictionary()
_verified_lock = threading.Lock()


class _UpdateRecorder(DynamicCache):
    """A `DynamicCache` that records which layers called `update()`."""

    def __init__(self, config) -> None:
        super().__init__(config=config)
        self.updated: set[int] = set()

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.updated.add(layer_idx)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def check_model_serves_dual(model, cache: DualDecoderCache, cache_arg: str, probe_input: dict) -> None:
    """Raise `ValueError` unless `model` passes the cache and the `dual_cache` keyword to the attention of every
    layer `cache` serves, with attention options the dual cache implements.

    Args:
        model: a transformers causal LM.
        cache: the request's `DualDecoderCache` (its layer types decide which layers must be reached).
        cache_arg: the forward argument that takes the cache (`"cache"` or `"past_key_values"`).
        probe_input: `{"input_ids": (1, 1) int64}` or `{"inputs_embeds": (1, 1, hidden)}`: one real input position
            of the request, for the probe forward.

    Raises:
        ValueError: for an attention implementation other than `SUPPORTED_IMPLEMENTATIONS`, a probe forward that
            fails, layers the cache or the keyword does not reach, or attention dropout / sinks.
    """
    implementation = model.config._attn_implementation
    if implementation not in SUPPORTED_IMPLEMENTATIONS:
        raise refuse("attention implementations other than sdpa and eager",
                     f"This model uses attn_implementation={implementation!r}")
    served = [i for i, layer in enumerate(cache.layers) if isinstance(layer, DualLayer)]
    key = (implementation, tuple(served))
    with _verified_lock:
        if key in _verified.get(model, ()):
            return
    probe, recorder = AttentionProbe(), _UpdateRecorder(model.config)
    first = next(iter(probe_input.values()))
    ones = torch.ones(1, 1, dtype=torch.long, device=first.device)
    # the uncompiled forward: `model.compile()` acts in `__call__`, a compiled forward keeps the original
    forward = getattr(model.forward, "_torchdynamo_orig_callable", model.forward)
    try:
        with torch.no_grad():
            forward(**probe_input, attention_mask=ones, position_ids=ones - 1, use_cache=True, logits_to_keep=1,
                  dual_cache=probe, **{cache_arg: recorder})
    except Exception as error:
        raise ValueError(
            f"A one-token forward of {type(model).__name__} with generate()'s arguments and the default cache "
            f"failed before the dual cache did any work ({type(error).__name__}: {error}). Fix the model call "
            "with the default cache first."
        ) from error
    name = type(model).__name__
    no_cache = [i for i in served if i not in recorder.updated]
    if no_cache:
        raise refuse("decoder layers that do not hand the cache to attention",
                     f"{name} does not hand the cache to the attention of layers {no_cache}")
    no_kwarg = [i for i in served if i not in probe.layers]
    if no_kwarg:
        raise refuse("decoder layers that do not pass generate()'s keyword arguments to attention",
                     f"{name}'s decoder layers {no_kwarg} do not pass generate()'s keyword arguments on to the "
                     "attention function")
    refused = {i: options for i, options in probe.unsupported.items() if i in served}
    if refused:
        raise refuse("attention dropout or attention sinks",
                     f"{name} asks its attention for options the dual cache does not implement ({refused})")
    with _verified_lock:
        _verified.setdefault(model, set()).add(key)
