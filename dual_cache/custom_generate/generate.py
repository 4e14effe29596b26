"""Dual decoding (the `dual-cache` package) as a transformers `custom_generate` recipe.

A model repository that holds this folder as `custom_generate/` (copy it there with
`dual-decoder export-generate <repo folder>`) offers dual decoding to anyone with `dual-cache` installed:

    model.generate(**inputs, custom_generate="<repo id or folder>", trust_remote_code=True,
                   cache_config={"budget": 256, "n_sink": 4, "window": 64}, max_new_tokens=64)

This gives the same tokens as `import dual_cache` followed by
`model.generate(..., cache_implementation="dual", cache_config=...)`: the function below imports the package
(which registers `cache_implementation="dual"` with transformers) and re-enters the model's standard
`generate()` with that cache implementation. Re-entering `generate()`, rather than handing transformers a
decoding callable, keeps every `generate()` feature working, streamers included.

Every argument of `generate()` is accepted and forwarded unchanged, except:
- `custom_generate` / `trust_remote_code` (they selected this recipe; forwarding them would recurse);
- `cache_implementation` must be absent or `"dual"`;
- a cache object (`cache=` / `past_key_values=`) must be absent or a `dual_cache.DualDecoderCache`.
"""

from __future__ import annotations

import contextvars
import dataclasses

from transformers.generation.utils import GenerationMixin

try:  # kept in a try block so that transformers' import scan defers to requirements.txt for the message
    import dual_cache
    from dual_cache.generate.integration import CACHE_IMPLEMENTATION
except ImportError as error:  # pragma: no cover - exercised only where dual-cache is missing
    raise ImportError(
        "This repository's custom_generate recipe needs the `dual-cache` package: `pip install dual-cache` "
        f"(see custom_generate/requirements.txt). Import failed with: {error}"
    ) from error

_CACHE_KWARGS = ("cache", "past_key_values")
_ACTIVE = contextvars.ContextVar("dual_cache_custom_generate_active", default=False)


def generate(*args, model=None, **kwargs):
    """Run `model.generate(*args, **kwargs)` with the dual cache (`cache_implementation="dual"`).

    transformers calls this as `generate(model=model, **generate_arguments)` when `generate()` receives
    `custom_generate=<this repo>`, and as `generate(*args, model=model, **kwargs)` when the model was loaded with
    `from_pretrained(<this repo>, trust_remote_code=True)` (its `generate` is then this function). Positional
    arguments are those of `GenerationMixin.generate` (`inputs`, `generation_config`, ...).

    Args:
        model: the `PreTrainedModel` to decode with (may also be passed as the first positional argument).
        kwargs: any `generate()` argument; `cache_config` (a dict or a `dual_cache.DualDecoderConfig`) configures
            the dual cache.

    Returns:
        Whatever `generate()` returns for the same arguments with `cache_implementation="dual"`.

    Raises:
        ValueError: for a non-dual `cache_implementation`, a non-dual cache object, a callable `custom_generate`,
            or a missing model; before any work starts.
        RuntimeError: if this recipe is re-entered while already running (a loop that would never end).
    """
    if model is None and args and isinstance(args[0], GenerationMixin):
        model, args = args[0], args[1:]
    if model is None:
        raise ValueError("custom_generate (dual-cache): no model given; call it as generate(model=model, ...).")

    custom = kwargs.pop("custom_generate", None)
    if custom is not None and not isinstance(custom, str):
        raise ValueError(
            "custom_generate (dual-cache): a callable custom_generate cannot be combined with this recipe, which "
            "runs transformers' own decoding loop with the dual cache. Drop one of them."
        )
    kwargs.pop("trust_remote_code", None)

    requested = kwargs.get("cache_implementation")
    if requested is not None and requested != CACHE_IMPLEMENTATION:
        raise ValueError(
            f"custom_generate (dual-cache) decodes with cache_implementation='{CACHE_IMPLEMENTATION}', but "
            f"cache_implementation={requested!r} was passed. Drop it, or call generate() without custom_generate."
        )
    user_cache = next((kwargs[k] for k in _CACHE_KWARGS if kwargs.get(k) is not None), None)
    if user_cache is not None and not isinstance(user_cache, dual_cache.DualDecoderCache):
        raise ValueError(
            f"custom_generate (dual-cache) decodes with a DualDecoderCache, but a {type(user_cache).__name__} was "
            "passed. Drop the cache argument (the recipe builds its own) or pass a fresh dual_cache.DualDecoderCache."
        )
    if user_cache is None:
        kwargs["cache_implementation"] = CACHE_IMPLEMENTATION
        if isinstance(kwargs.get("cache_config"), dual_cache.DualDecoderConfig):
            kwargs["cache_config"] = dataclasses.asdict(kwargs["cache_config"])

    if _ACTIVE.get():
        raise RuntimeError(
            "custom_generate (dual-cache) was re-entered while it was already running; refusing to recurse. This "
            "happens when the model class's own generate() routes back to the instance's generate attribute."
        )
    token = _ACTIVE.set(True)
    try:
        # `type(model).generate`, not `model.generate`: a model loaded with `from_pretrained(...,
        # trust_remote_code=True)` from a repo holding this folder has `model.generate` bound to this very function.
        return type(model).generate(model, *args, **kwargs)
    finally:
        _ACTIVE.reset(token)
