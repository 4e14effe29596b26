"""The `"dual"` attention function and its mask function, registered with transformers' interfaces.

Full-attention layers of a `DualDecoderCache`: dense SDPA during prefill (over the layer's host store, one layer
at a time on the device), sparse attention over the device segments sink, selection and window ring (which holds
the step's new tokens) during decode, read in place. The mask
function is registered under the same name so the attention function receives the real padding + causal mask
(without it transformers passes None and SDPA would treat the two decode queries as a causal prefix).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .cache import DualLayer
from .kernels import sparse_decode_attention

ATTENTION_NAME = "dual"


def dual_mask(*args, **kwargs):
    """Mask function for `"dual"`: the boolean `(B, 1, q, kv)` SDPA mask (True = attend), or None when plain
    causal without padding (transformers' `sdpa_mask`)."""
    return sdpa_mask(*args, **kwargs)


def dual_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention for one layer (transformers `AttentionInterface` signature).

    Args:
        module: the attention module (`module.layer_idx` picks the cache layer).
        query: `(B, H_q, q, D)` after RoPE; key, value: `(B, H_kv, q, D)` as returned by the cache update.
        attention_mask: `(B, 1, q, n)` bool from `dual_mask`, or None; used by prefill. Decode masks with the
            cache's own per-entry positions and validity (pads never enter the tiers).
        kwargs: must carry `dual_cache` (the `DualDecoderCache`) for sparse attention; without it, or for
            sliding-window layers, this is transformers' SDPA attention.

    Returns:
        `(B, q, H_q, D)` attention output and None (no weights).

    Raises:
        ValueError: for logit soft-capping or attention dropout, which this function does not implement.
    """
    cache = kwargs.pop("dual_cache", None)
    layer = cache.layers[module.layer_idx] if cache is not None else None
    if not isinstance(layer, DualLayer):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if kwargs.get("softcap") is not None or dropout:
        raise ValueError(
            "The dual cache does not support attention logit soft-capping or attention dropout; "
            "use the default cache for this model."
        )
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    if not layer.decoding:
        keys, values = layer.prefill_kv(key, value)
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            cache.record_prompt_validity(attention_mask[:, 0, -1, :])
        layer.record_query(query[:, :, -1], scaling)
        layer.index_prompt()
        return sdpa_attention_forward(module, query, keys, values, attention_mask, scaling=scaling, **kwargs)

    q_len = query.shape[2]
    segments = layer.decode_segments(query, scaling)
    n = layer.get_seq_length()
    query_positions = torch.arange(n - q_len, n, device=query.device)
    out = sparse_decode_attention(query, segments, query_positions, scaling, backend=layer.config.attention_kernel)
    layer.release()
    if layer.selector is not None and layer.selector.prefetched:
        layer.submit_selection(query[:, :, -1], committed=n - q_len + 1)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register `"dual"` with `AttentionInterface` and `AttentionMaskInterface` (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, dual_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, dual_mask)
