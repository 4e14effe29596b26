"""Plain torch reference of decode attention over gathered (sink + selection + window + new) entries."""

from __future__ import annotations

import torch


def sparse_decode_attention_reference(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    allowed: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Attention of a few decode queries over per-(sequence, KV head) gathered keys, with GQA.

    Args:
        query: `(B, H_q, q, D)` queries after RoPE (q = 1 or 2: real and speculated token).
        keys, values: `(B, H_kv, S, D)` gathered resident entries; `H_q` must be a multiple of `H_kv`
            (query head h reads KV head `h // (H_q // H_kv)`).
        allowed: `(B, H_kv, q, S)` bool, True where query slot i may attend entry j (padding, unused slots and
            causality between the new tokens already applied). Every row must allow at least one entry.
        scaling: softmax scale.

    Returns:
        `(B, H_q, q, D)` in `query.dtype`; softmax is computed by `scaled_dot_product_attention`.

    Raises:
        ValueError: if `H_q` is not a multiple of `H_kv` or shapes disagree.
    """
    batch, q_heads, q_len, dim = query.shape
    kv_heads = keys.shape[1]
    if q_heads % kv_heads or keys.shape != values.shape or allowed.shape != (batch, kv_heads, q_len, keys.shape[2]):
        raise ValueError(
            f"Shapes do not match: query {tuple(query.shape)}, keys {tuple(keys.shape)}, values "
            f"{tuple(values.shape)}, allowed {tuple(allowed.shape)}."
        )
    groups = q_heads // kv_heads
    grouped = query.reshape(batch, kv_heads, groups * q_len, dim)
    mask = allowed[:, :, None].expand(batch, kv_heads, groups, q_len, keys.shape[2]).reshape(
        batch, kv_heads, groups * q_len, keys.shape[2]
    )
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped, keys.to(query.dtype), values.to(query.dtype), attn_mask=mask, scale=scaling
    )
    return out.reshape(batch, q_heads, q_len, dim)
