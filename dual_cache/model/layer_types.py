"""Which layers of a model the dual cache serves as full attention, for a request of a given length.

A model's layers are full attention or slide over a window (`config.layer_types`; models such as Mistral or Phi-3
give only `config.sliding_window`, which then applies to every layer, as in transformers' own `DynamicCache`). A
window at least as long as the request attends to every token, so such a layer is full attention for that request
and the dual cache serves it (host store + selection); a layer whose window is shorter than the request keeps its
window on the device, as the default cache does.
"""

from __future__ import annotations

from typing import Any

from ..runtime.refusals import refuse

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


def check_attention_model(text_config: Any) -> None:
    """Raise the refusal `ValueError` unless `text_config` describes a model the dual cache can serve: attention
    heads (`num_attention_heads`, a positive int) and only full and sliding-window attention layers. Reads nothing
    else, so it runs first, before any attribute a cache needs (the KV heads, the head dim) is read.

    Raises:
        ValueError: "models without attention heads" (Mamba, RWKV, xLSTM: no `num_attention_heads`), or "layer types
            other than full and sliding-window attention" (hybrids such as Jamba, Zamba, Bamba, Qwen3-Next).
    """
    heads = getattr(text_config, "num_attention_heads", None)
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        raise refuse("models without attention heads",
                     f"{type(text_config).__name__} declares num_attention_heads={heads!r}")
    resolve_layer_types(text_config, None)


def resolve_layer_types(text_config: Any, tokens: int | None) -> list[str]:
    """Attention type of each layer for a request of `tokens` tokens per sequence (prompt + new tokens + the
    speculated one): `FULL_ATTENTION` or `SLIDING_ATTENTION`.

    Args:
        text_config: the model's text (decoder) config: `num_hidden_layers`, and `layer_types` and/or
            `sliding_window`.
        tokens: tokens per sequence of the request; None when not known yet (every sliding window is then taken
            as shorter than the request).

    Raises:
        ValueError: for layer types other than full and sliding-window attention.
    """
    n_layers = text_config.num_hidden_layers
    sliding_window = getattr(text_config, "sliding_window", None)
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is None:
        layer_types = [SLIDING_ATTENTION if sliding_window else FULL_ATTENTION] * n_layers
    unsupported = sorted({t for t in layer_types if t not in (FULL_ATTENTION, SLIDING_ATTENTION)})
    if unsupported:
        raise refuse("layer types other than full and sliding-window attention",
                     f"This model has layer types {unsupported}")
    if tokens is not None and sliding_window and tokens <= sliding_window:
        return [FULL_ATTENTION] * len(layer_types)
    return list(layer_types)
