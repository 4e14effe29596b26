"""Plain torch reference of sparse decode attention over device-resident KV segments (sink, selection, window).

The segments are read as they lie on the device, never concatenated by the caller: each carries its own token
positions and validity, and attention is permutation-invariant over entries, so a window ring buffer can be passed
in slot order.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch


class KVSegment(NamedTuple):
    """One device-resident group of KV entries (e.g. sink tokens, a selection, the window ring).

    Attributes:
        keys, values: `(B, H_kv, L, D)` float tensors (fp16/bf16/fp32), the same dtype in every segment.
        positions: int64 token positions (cache indices) of the entries, broadcastable to `(B, H_kv, L)`.
        valid: bool, broadcastable to `(B, H_kv, L)`; False for padding, unused slots and entries that must be
            skipped (e.g. window slots already held by the sink).
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor


def check_segments(query: torch.Tensor, segments: Sequence[KVSegment], query_positions: torch.Tensor) -> None:
    """Validate shapes shared by every implementation of `sparse_decode_attention`.

    Raises:
        ValueError: naming the offending argument when shapes, dtypes or the GQA ratio do not match.
    """
    if query.dim() != 4:
        raise ValueError(f"query must be (B, H_q, q, D), got shape {tuple(query.shape)}.")
    batch, q_heads, q_len, dim = query.shape
    if not segments:
        raise ValueError("sparse decode attention needs at least one KV segment.")
    kv_heads = segments[0].keys.shape[1]
    if q_heads % kv_heads:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of KV heads ({kv_heads}).")
    for i, seg in enumerate(segments):
        if seg.keys.dim() != 4 or seg.keys.shape != seg.values.shape:
            raise ValueError(
                f"segment {i}: keys and values must both be (B, H_kv, L, D), got {tuple(seg.keys.shape)} and "
                f"{tuple(seg.values.shape)}."
            )
        if seg.keys.shape[0] != batch or seg.keys.shape[1] != kv_heads or seg.keys.shape[3] != dim:
            raise ValueError(
                f"segment {i}: keys {tuple(seg.keys.shape)} do not match query {tuple(query.shape)} "
                f"(batch, KV heads {kv_heads}, head_dim)."
            )
        if seg.keys.dtype != segments[0].keys.dtype or seg.values.dtype != seg.keys.dtype:
            raise ValueError(f"segment {i}: every segment's keys and values must share one dtype.")
        shape = (batch, kv_heads, seg.keys.shape[2])
        for name in ("positions", "valid"):
            tensor_shape = tuple(getattr(seg, name).shape)
            if len(tensor_shape) > 3 or any(d not in (1, t) for d, t in zip(tensor_shape[::-1], shape[::-1])):
                raise ValueError(f"segment {i}: {name} {tensor_shape} does not broadcast to {shape}.")
        if seg.valid.dtype != torch.bool or seg.positions.dtype != torch.int64:
            raise ValueError(f"segment {i}: valid must be bool and positions int64.")
    if query_positions.shape not in ((batch, q_len), (q_len,)):
        raise ValueError(f"query_positions must be (B, q) or (q,), got {tuple(query_positions.shape)}.")


def sparse_decode_attention_reference(
    query: torch.Tensor,
    segments: Sequence[KVSegment],
    query_positions: torch.Tensor,
    scaling: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of a few decode queries over KV segments, GQA/MQA, fp32 softmax.

    Masking: query slot i of sequence b may attend entry j iff `valid[b, h, j]` and
    `positions[b, h, j] <= query_positions[b, i]` (so the real and speculated tokens are causal to each other).
    A query row with no allowed entry returns zeros.

    Args:
        query: `(B, H_q, q, D)` queries after RoPE (q = 1 or 2: the real and the speculated token); query head h
            reads KV head `h // (H_q / H_kv)`.
        segments: `KVSegment`s, all with the same B, H_kv, D and dtype.
        query_positions: `(B, q)` or `(q,)` int64 cache positions of the queries.
        scaling: softmax scale (usually `D ** -0.5`).
        softcap: logit soft-capping (Gemma 2): scaled logits `s` become `softcap * tanh(s / softcap)` before the
            softmax, as transformers' eager attention does; None = off.

    Returns:
        `(B, H_q, q, D)` in `query.dtype`.

    Raises:
        ValueError: from `check_segments` for mismatched shapes or dtypes.
    """
    check_segments(query, segments, query_positions)
    batch, q_heads, q_len, dim = query.shape
    kv_heads = segments[0].keys.shape[1]
    groups = q_heads // kv_heads
    keys = torch.cat([s.keys for s in segments], dim=2).float()
    values = torch.cat([s.values for s in segments], dim=2).float()
    positions = torch.cat([s.positions.expand(batch, kv_heads, s.keys.shape[2]) for s in segments], dim=2)
    valid = torch.cat([s.valid.expand(batch, kv_heads, s.keys.shape[2]) for s in segments], dim=2)
    qpos = query_positions.expand(batch, q_len) if query_positions.dim() == 1 else query_positions
    allowed = valid[:, :, None, :] & (positions[:, :, None, :] <= qpos[:, None, :, None])  # (B, H_kv, q, S)
    grouped = query.float().reshape(batch, kv_heads, groups, q_len, dim)
    logits = torch.einsum("bhgqd,bhsd->bhgqs", grouped, keys) * scaling
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.masked_fill(~allowed[:, :, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # all-masked rows give NaN → 0
    # an entry no query may attend holds bytes nobody wrote (an unused slot): a zero weight times NaN is NaN
    values = values.masked_fill(~allowed.any(dim=2)[..., None], 0.0)
    out = torch.einsum("bhgqs,bhsd->bhgqd", probs, values)
    return out.reshape(batch, q_heads, q_len, dim).to(query.dtype)
