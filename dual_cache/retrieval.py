"""Host-side scoring and top-k selection of critical KV entries (DESIGN.md §2, step 3).

Pure torch on host tensors; knows nothing of transformers, caches or devices.
"""

from __future__ import annotations

import torch


def group_attention_mass(
    query: torch.Tensor, keys: torch.Tensor, candidates: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Attention probability of each candidate key, summed over the query heads of each GQA group.

    Args:
        query: `(B, H_q, D)` float queries (after RoPE) of the token whose attention is predicted.
        keys: `(B, H_kv, n, D)` host keys of positions `[0, n)`; `H_q` must be a multiple of `H_kv`.
        candidates: `(B, n)` bool, True where a position may be selected.
        scaling: softmax scale (usually `D ** -0.5`).

    Returns:
        `(B, H_kv, n)` float32 mass in `[0, G]` (G = H_q / H_kv); 0 at non-candidates.
    """
    batch, q_heads, dim = query.shape
    kv_heads = keys.shape[1]
    grouped = query.reshape(batch, kv_heads, q_heads // kv_heads, dim).to(keys.dtype)
    logits = torch.matmul(grouped, keys.transpose(-1, -2)).float() * scaling  # (B, H_kv, G, n)
    logits.masked_fill_(~candidates[:, None, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)  # rows without candidates give NaN → 0
    return probs.sum(dim=2)


def select_topk(mass: torch.Tensor, candidates: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level top-k of `mass` (B, H_kv, n), returned sorted by position.

    Returns:
        `indices` (B, H_kv, budget) int64 positions in ascending order and `valid` (B, H_kv, budget) bool; slots
        beyond the number of candidates are marked invalid (their index is an arbitrary in-range position).
    """
    batch, kv_heads, n = mass.shape
    k = min(budget, n)
    top = torch.topk(mass, k, dim=-1, sorted=False).indices
    indices, _ = torch.sort(top, dim=-1)
    valid = torch.gather(candidates[:, None, :].expand(batch, kv_heads, n), 2, indices)
    if k < budget:
        pad = budget - k
        indices = torch.cat([indices, indices.new_zeros(batch, kv_heads, pad)], dim=-1)
        valid = torch.cat([valid, valid.new_zeros(batch, kv_heads, pad)], dim=-1)
    return indices, valid


def select_blocks(
    mass: torch.Tensor, candidates: torch.Tensor, budget: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-level top-k: blocks of `block_size` consecutive positions ranked by their summed mass.

    `budget` must be a multiple of `block_size`; returns `indices`, `valid` as `select_topk` does (positions
    past `n` or outside the candidates are invalid).
    """
    batch, kv_heads, n = mass.shape
    n_blocks = -(-n // block_size)
    padded = torch.nn.functional.pad(mass, (0, n_blocks * block_size - n))
    block_mass = padded.view(batch, kv_heads, n_blocks, block_size).sum(-1)
    k_blocks = min(budget // block_size, n_blocks)
    top = torch.topk(block_mass, k_blocks, dim=-1, sorted=False).indices
    blocks, _ = torch.sort(top, dim=-1)
    offsets = torch.arange(block_size, device=mass.device)
    indices = (blocks[..., None] * block_size + offsets).flatten(2)
    in_range = indices < n
    indices = torch.where(in_range, indices, torch.zeros_like(indices))
    valid = in_range & torch.gather(candidates[:, None, :].expand(batch, kv_heads, n), 2, indices)
    short = budget - indices.shape[-1]
    if short:
        indices = torch.cat([indices, indices.new_zeros(batch, kv_heads, short)], dim=-1)
        valid = torch.cat([valid, valid.new_zeros(batch, kv_heads, short)], dim=-1)
    return indices, valid


def select(
    query: torch.Tensor,
    keys: torch.Tensor,
    candidates: torch.Tensor,
    budget: int,
    scaling: float,
    block_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose `budget` entries per (sequence, KV head) that `query` attends to most.

    Args:
        query: `(B, H_q, D)`; keys: `(B, H_kv, n, D)`; candidates: `(B, n)` bool (see `group_attention_mass`).
        budget: entries per KV head (tokens); block_size: 1 for token-level, else block-level selection.

    Returns:
        `(indices, valid)`, both `(B, H_kv, budget)`: int64 positions sorted ascending, and bool validity.
    """
    mass = group_attention_mass(query, keys, candidates, scaling)
    if block_size == 1:
        return select_topk(mass, candidates, budget)
    return select_blocks(mass, candidates, budget, block_size)
