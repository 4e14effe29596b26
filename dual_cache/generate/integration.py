"""Registers `cache_implementation="dual"` with transformers' `generate()` (idempotent, on `import dual_cache`).

transformers has no registry for cache implementations (docs/design.md §4): `GenerationConfig.validate` accepts names
from the module-level tuple `ALL_CACHE_IMPLEMENTATIONS`, and `_prepare_cache_for_generation` silently builds a
`DynamicCache` for unknown names. We extend the tuple, wrap `_prepare_cache_for_generation` to build a
`DualDecoderCache` (and refuse unsupported generation modes before any work), and wrap `_sample` to run the
dual-token loop whenever the cache is a `DualDecoderCache`; `layer/routing.py` sends a call's attention to the dual
cache when the call carries it. Every other cache implementation is untouched.
"""

from __future__ import annotations

import functools

from transformers.generation import configuration_utils
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.utils import GenerationMixin

from ..cache.cache import DualDecoderCache
from ..config import DualDecoderConfig
from ..layer import routing
from ..model.inputs import cache_kwarg_name
from ..runtime.refusals import refuse
from .decoding import CACHE_KWARGS, CLOSE_AFTER, dual_sample

CACHE_IMPLEMENTATION = "dual"
_SUPPORTED_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)


def check_generation_supported(generation_config, generation_mode) -> None:
    """Raise `ValueError` for generation settings the dual cache cannot serve (before any work starts; the reasons:
    `refusals.REFUSED`)."""
    if generation_mode not in _SUPPORTED_MODES:
        raise refuse(GenerationMode(generation_mode).value)
    if generation_config.output_attentions:
        raise refuse("output_attentions")
    if generation_config.use_cache is False:
        raise refuse("use_cache=False")


def _wrap_prepare_cache(original):
    @functools.wraps(original)
    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length):
        user_cache = next((model_kwargs[k] for k in CACHE_KWARGS if model_kwargs.get(k) is not None), None)
        if generation_config.cache_implementation == CACHE_IMPLEMENTATION:
            if user_cache is not None:
                raise ValueError(
                    "Passing both cache_implementation='dual' and a cache object is unsupported; pass only the cache "
                    "(e.g. the DualDecoderCache a previous dual generate() returned) to continue it."
                )
            check_generation_supported(generation_config, generation_mode)
            options = generation_config.cache_config
            dual_config = options if isinstance(options, DualDecoderConfig) else DualDecoderConfig.from_dict(options)
            model_kwargs[cache_kwarg_name(self)] = DualDecoderCache(
                self.config, dual_config=dual_config, max_cache_len=max_cache_length + 2
            )
            if not generation_config.return_dict_in_generate:  # nobody can continue it: close it when done
                model_kwargs[CLOSE_AFTER] = True
            return None
        if isinstance(user_cache, DualDecoderCache):
            check_generation_supported(generation_config, generation_mode)
        return original(self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)

    _prepare_cache_for_generation._dual_cache_wrapped = True
    return _prepare_cache_for_generation


def _wrap_sample(original):
    @functools.wraps(original)
    def _sample(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                streamer=None, **model_kwargs):
        if any(isinstance(model_kwargs.get(k), DualDecoderCache) for k in CACHE_KWARGS):
            return dual_sample(self, input_ids, logits_processor, stopping_criteria, generation_config,
                               synced_gpus=synced_gpus, streamer=streamer, **model_kwargs)
        return original(self, input_ids, logits_processor, stopping_criteria, generation_config,
                        synced_gpus=synced_gpus, streamer=streamer, **model_kwargs)

    _sample._dual_cache_wrapped = True
    return _sample


def register() -> None:
    """Make `cache_implementation="dual"` available to `generate()`. Idempotent; other caches are untouched."""
    routing.register()
    if CACHE_IMPLEMENTATION not in configuration_utils.ALL_CACHE_IMPLEMENTATIONS:
        configuration_utils.ALL_CACHE_IMPLEMENTATIONS = configuration_utils.ALL_CACHE_IMPLEMENTATIONS + (
            CACHE_IMPLEMENTATION,
        )
    if not getattr(GenerationMixin._prepare_cache_for_generation, "_dual_cache_wrapped", False):
        GenerationMixin._prepare_cache_for_generation = _wrap_prepare_cache(GenerationMixin._prepare_cache_for_generation)
    if not getattr(GenerationMixin._sample, "_dual_cache_wrapped", False):
        GenerationMixin._sample = _wrap_sample(GenerationMixin._sample)
