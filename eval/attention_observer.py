"""Watch what each decode step of a dual cache attends to: `observe_attention(cache, observer)` calls
`observer(layer, query, scaling, step)` after every `DualLayer.begin_attention` of every full-attention layer with
a budget, from the cache's first decode step on. Used by the GPU check (`gpu_check.record_attended`) and the tests that check
what a step attends to (miss repair, padded batches); the library itself never calls it.
"""

from __future__ import annotations

from typing import Any, Callable


def observe_attention(cache: Any, observer: Callable[[Any, Any, float, Any], None]) -> None:
    """Wrap `begin_attention` of each of `cache`'s `DualLayer`s with a budget, once, when the cache starts a
    request's schedule (its layers are built by then).

    Args:
        cache: a `DualDecoderCache` before its first request.
        observer: called as `observer(layer, query, scaling, step)` after the layer's `begin_attention(query,
            scaling, ...)` returned `step` (`layer.StepAttention`: `step.segments[1]` is the resident set after the
            step's delta and any miss repair); `query`: the step's `(B, H_q, S, D)` query; `scaling`: the softmax
            scale (float). Its return value is ignored.
    """
    original_ensure = cache._ensure_schedule

    def ensure(device):
        original_ensure(device)
        for layer in cache.dual_layers:
            if layer.budget == 0 or getattr(layer, "_observed", False):
                continue
            begin = layer.begin_attention

            def spy(query, scaling, *args, layer=layer, begin=begin, **kwargs):
                step = begin(query, scaling, *args, **kwargs)
                observer(layer, query, scaling, step)
                return step

            layer.begin_attention = spy
            layer._observed = True

    cache._ensure_schedule = ensure
