"""Per-call routing of attention to the dual cache, without touching the model.

Every attention module of a transformers model asks `AttentionInterface.get_interface(config._attn_implementation,
eager_attention_forward)` for its attention function on each forward. `register()` wraps that lookup (once, at
`import dual_cache`) so it returns the model's own function behind a router: a call that carries a `dual_cache`
keyword argument (the decode loop passes one to `model(...)`, transformers forwards it to the attention function)
goes to `dual_attention`, which uses the model's own function for dense work (prefill, sliding-window layers);
every other call goes straight to the model's own function with the same arguments. So the model's configuration
is never switched per call: default-cache calls, other attention implementations and concurrent `generate()` calls
on one model, each with its own dual cache, never see each other.
"""

from __future__ import annotations

from typing import Callable

import torch
from transformers.modeling_utils import AttentionInterface

from .attention import dual_attention

SUPPORTED_IMPLEMENTATIONS = ("sdpa", "eager")  # whose masks the dual prefill reads (bool / additive float)


class AttentionProbe:
    """Passed as `dual_cache` in a probe forward (`checks.check_model_serves_dual`): records which layers' attention
    functions receive it, and runs the model's own attention.

    Attributes:
        layers: `module.layer_idx` of every attention call that received the probe.
        unsupported: `{layer_idx: [keyword, ...]}` for calls with attention options the dual cache does not
            implement (dropout > 0; attention sinks `s_aux`).
    """

    def __init__(self) -> None:
        self.layers: set[int] = set()
        self.unsupported: dict[int, list[str]] = {}

    def attend(self, model_attention: Callable, module, query, key, value, attention_mask, **kwargs):
        layer_idx = getattr(module, "layer_idx", None)
        self.layers.add(layer_idx)
        refused = [name for name in ("s_aux", "sinks") if kwargs.get(name) is not None]
        if kwargs.get("dropout"):
            refused.append(f"dropout={kwargs['dropout']}")
        if refused:
            self.unsupported[layer_idx] = refused
        return model_attention(module, query, key, value, attention_mask, **kwargs)


def routed(model_attention: Callable) -> Callable:
    """The attention function a module gets: `model_attention` (the model's own) unless the call carries
    `dual_cache`."""

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        call = kwargs.pop("dual_cache", None)
        if call is None:
            return model_attention(module, query, key, value, attention_mask, *args, **kwargs)
        if isinstance(call, AttentionProbe):
            return call.attend(model_attention, module, query, key, value, attention_mask, *args, **kwargs)
        return _dual(module, query, key, value, attention_mask, *args, model_attention=model_attention, call=call, **kwargs)

    attention.__wrapped__ = model_attention
    return attention


@torch.compiler.disable
def _dual(*args, **kwargs):
    """`dual_attention`, run eagerly under `torch.compile`: a graph break around the cache's host-side work."""
    return dual_attention(*args, **kwargs)


def register() -> None:
    """Wrap `AttentionInterface.get_interface` with the router (idempotent)."""
    original = AttentionInterface.get_interface
    if getattr(original, "_dual_cache_routed", False):
        return

    def get_interface(self, attn_implementation: str, default: Callable) -> Callable:
        return routed(original(self, attn_implementation, default))

    get_interface._dual_cache_routed = True
    get_interface.__doc__ = original.__doc__
    AttentionInterface.get_interface = get_interface
