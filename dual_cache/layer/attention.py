"""The dual attention function: what a layer of a `DualDecoderCache` computes (routed here by `routing.py`).

Full-attention layers of a `DualDecoderCache`: dense attention during prefill with the model's own attention
function (over the layer's host store, one layer at a time on the device), sparse attention over the device
segments sink, resident set and window ring (which holds the step's new tokens) during decode, read in place
(`DualLayer.begin_attention` / `end_attention` around the kernel). Prefill
reads the model's own mask (boolean for `sdpa`, additive float for `eager`); decode masks with the cache's own
per-entry positions and validity.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..kernels import sparse_decode_attention
from ..runtime.refusals import refuse
from .call import DualCall
from .layer import DualLayer


def dual_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    *,
    model_attention: Callable,
    call: DualCall,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention for one layer (transformers `AttentionInterface` signature).

    Args:
        module: the attention module (`module.layer_idx` picks the cache layer).
        query: `(B, H_q, q, D)` after RoPE; key, value: `(B, H_kv, q, D)` as returned by the cache update.
        attention_mask: the model's own mask for its attention implementation: `(B, 1, q, n)` bool (`sdpa`,
            True = attend) or additive float (`eager`, 0 = attend), or None (causal, no padding); used by
            prefill. Decode masks with the cache's own per-entry positions and validity (pads never enter the
            tiers).
        model_attention: the model's own attention function (same signature); computes prefill over the layer's keys
            and values, and every layer that is not a `DualLayer` (sliding-window layers).
        call: the forward's plan (`call.DualCall`: the cache's layers and, in a decode step, its rows).
        kwargs: the model's attention options; `softcap` (logit soft-capping, Gemma 2) is applied in decode too.

    Returns:
        `(B, q, H_q, D)` attention output, and None in decode (whatever weights the model's own function returns
        in prefill and for other layers).

    Raises:
        ValueError: for attention dropout, which decode does not implement (`checks` refuses it before any work).
    """
    layer = call.layers[module.layer_idx]
    if not isinstance(layer, DualLayer):
        return model_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if dropout:
        raise refuse("attention dropout or attention sinks", f"Attention dropout {dropout}")
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    if not layer.decoding:
        keys, values = layer.prefill_kv(key, value)
        layer.end_prefill_chunk(query[:, :, -1], scaling)
        return model_attention(module, query, keys, values, attention_mask, scaling=scaling, **kwargs)

    q_len = query.shape[2]
    step = layer.begin_attention(query, scaling, call.rows, kwargs.get("softcap"))
    n = layer.get_seq_length()
    query_positions = torch.arange(n - q_len, n, device=query.device)
    out = sparse_decode_attention(
        query, step.segments, query_positions, scaling, backend=layer.config.attention_kernel,
        softcap=kwargs.get("softcap")
    )
    layer.end_attention(query, step)
    return out.transpose(1, 2).contiguous(), None

