"""Two-stage host selection (`selector="shortlist"`): a few key channels shortlist tokens, exact top-k among them.

Exact selection (`retrieval.select`) reads every host key of every layer at every step — 2 GiB per sequence per
step for a Llama-3.1-8B-shaped model at 32K tokens in bf16, which bounded decode on an H200 to 2 tokens/s
(results/gpu/h200-32k.md). Here, per (sequence, KV head):

1. approximate: the `r` channels where the query is largest (|q| summed over the GQA group) give an approximate
   score `q̄_r · k_r` for every candidate, read from a channel-major copy of the keys
   (`HostKVStore.channel_products`, `r / D` of the key bytes); `q̄_r` is the group's mean partial query, each
   head scaled by the softmax temperature correction `sqrt(‖q‖₁ / ‖q_r‖₁)` of SparQ attention (Ribar et al., 2023,
   §3); the `keep` best-scoring positions are the shortlist;
2. exact scores: the criterion of `retrieval.select` — softmax attention mass summed over the group — with exact
   logits, over the shortlisted positions only, top-`budget`. Each query head's softmax is normalised over the
   shortlist, not over every candidate; with GQA (G > 1) the ranking can therefore differ from the exact top-k
   even when the shortlist holds all of it (each head's missing mass shifts its weight in the sum). The recall
   figures below include this effect.

When `keep` covers every scored position, the result is the exact selection, and `select_shortlisted` calls
`retrieval.select` directly (the early layers' larger budgets, short contexts).
Measured on the embedded model at 8K tokens (results/needle/selection-recall-8k.md): `r = D/8`, `keep = 8 × budget`
keeps 99.8% of the exact top-256 attention mass on average.
"""

from __future__ import annotations

import torch

from .host_store import HostKVStore
from .retrieval import group_attention_mass, select


def shortlist_positions(
    query: torch.Tensor, host: HostKVStore, candidates: torch.Tensor, hi: int, channels: int, keep: int,
    first_sequence: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1: the `keep` positions per (sequence, KV head) of highest approximate score.

    The score of position `p` is `q̄_r · k_r[p]`: `r` channels chosen by |q| summed over the GQA group, and `q̄_r` the
    group's mean of those channels with each head scaled by SparQ's temperature `sqrt(‖q‖₁ / ‖q_r‖₁)`. One score
    row per KV head (not one per query head): ranking needs no softmax, and measured on the embedded model it keeps
    the same share of the exact mass as the group's summed approximate softmax (99.8% at 8K). With bf16 keys the
    scores are bf16 products (ties at the shortlist's edge are broken arbitrarily).

    Args:
        query: `(B, H_q, D)` float32 (after RoPE); `H_q` a multiple of the store's `H_kv`.
        host: the layer's store, built with `channel_major=True`.
        candidates: `(B, hi)` bool selectable positions; hi: positions `[0, hi)` are scored (positive).
        channels: `r`, query channels used per KV head (clamped to `D`); keep: positions returned per KV head.
        first_sequence: the `B` rows are the store's sequences `first_sequence, …` (a repair of some sequences).

    Returns:
        `positions` `(B, H_kv, m)` int64 in `[0, hi)` and `usable` `(B, H_kv, m)` bool (False where the position
        is not a candidate), `m = min(keep, hi)`.
    """
    batch, q_heads, dim = query.shape
    kv_heads = host.shape_prefix[1]
    grouped = query.reshape(batch, kv_heads, q_heads // kv_heads, dim)
    r = min(channels, dim)
    chosen = torch.topk(grouped.abs().sum(dim=2), r, dim=-1).indices  # (B, H_kv, r)
    partial = torch.gather(grouped, 3, chosen[:, :, None, :].expand(-1, -1, grouped.shape[2], -1))
    temperature = (grouped.abs().sum(-1, keepdim=True) / partial.abs().sum(-1, keepdim=True).clamp(min=1e-30)).sqrt()
    mean = (partial * temperature).mean(dim=2, keepdim=True).to(host.dtype)  # (B, H_kv, 1, r)
    score = host.channel_products(mean, chosen, hi, first_sequence)[:, :, 0]  # (B, H_kv, hi) float32
    bias = torch.zeros(candidates.shape, dtype=score.dtype).masked_fill_(~candidates, float("-inf"))
    score += bias[:, None, :]
    positions = torch.topk(score, min(keep, hi), dim=-1, sorted=False).indices
    usable = torch.gather(candidates[:, None, :].expand(batch, kv_heads, hi), 2, positions)
    return positions, usable


def select_shortlisted(
    query: torch.Tensor,
    host: HostKVStore,
    candidates: torch.Tensor,
    hi: int,
    budget: int,
    channels: int,
    keep: int,
    scaling: float,
    first_sequence: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose `budget` entries per (sequence, KV head): top-k by exact attention mass among `keep` shortlisted ones.

    Args:
        query: `(B, H_q, D)` float32 query (after RoPE) of the token predicting the step.
        host: the layer's store (`channel_major=True`); candidates: `(B, hi)` bool selectable positions (real, not
            sink, below `hi`); `hi` must be positive.
        budget: entries per KV head (tokens); channels, keep: see `shortlist_positions`; scaling: softmax scale.
        first_sequence: the `B` rows of `query`/`candidates` are the store's sequences `first_sequence, …`.

    Returns:
        `(indices, valid)`, both `(B, H_kv, budget)`: int64 positions, the valid ones in ascending order, and bool
        validity; invalid slots hold arbitrary in-range positions — the contract of `retrieval.select`.
    """
    host.first_row(first_sequence, query.shape[0])  # ValueError for rows outside the store's batch
    if keep >= hi:  # every position would be shortlisted: the exact selection, without the approximate stage
        rows = slice(first_sequence, first_sequence + query.shape[0])
        return select(query, [chunk[rows] for chunk in host.key_chunks(hi)], candidates, budget, scaling)
    positions, usable = shortlist_positions(query, host, candidates, hi, channels, keep, first_sequence)
    batch, kv_heads, m = positions.shape
    keys = host.gather_keys(positions, first_sequence)
    mass = group_attention_mass(query, keys, usable, scaling)  # (B, H_kv, m)
    k = min(budget, m)
    top = torch.topk(mass, k, dim=-1, sorted=False).indices
    valid = torch.gather(usable, 2, top)
    indices = torch.where(valid, torch.gather(positions, 2, top), torch.zeros_like(top))
    indices, order = torch.sort(indices, dim=-1)
    valid = torch.gather(valid, 2, order)
    if k < budget:
        pad = budget - k
        indices = torch.cat([indices, indices.new_zeros(batch, kv_heads, pad)], dim=-1)
        valid = torch.cat([valid, valid.new_zeros(batch, kv_heads, pad)], dim=-1)
    return indices, valid
