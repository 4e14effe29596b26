"""Quest's page selection (`selector="quest"`): page bounds, the pages a query's bound ranks best, and the padding of
a selection to the budget (docs/design.md §2, step 3).

Pure torch; knows nothing of transformers, caches or devices. Exact selection in pure torch (group attention mass
and its token top-k), which only the eval tools and tests use, lives in `dual_cache.eval.selection.torch_exact`.
"""

from __future__ import annotations

import torch


def pad_selection(indices: torch.Tensor, valid: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Widen `(B, H_kv, k)` `indices` / `valid` to `budget` slots with invalid entries at position 0."""
    short = budget - indices.shape[-1]
    if short <= 0:
        return indices, valid
    batch, kv_heads = indices.shape[:2]
    return (torch.cat([indices, indices.new_zeros(batch, kv_heads, short)], dim=-1),
            torch.cat([valid, valid.new_zeros(batch, kv_heads, short)], dim=-1))


def _top_blocks(
    block_score: torch.Tensor, candidates: torch.Tensor, budget: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token positions of the `budget // block_size` best blocks of `block_score` `(B, H_kv, n_blocks)`, block `j`
    covering `[j·block_size, (j+1)·block_size)`."""
    batch, kv_heads, n_blocks = block_score.shape
    n = candidates.shape[1]
    k_blocks = min(budget // block_size, n_blocks)
    top = torch.topk(block_score, k_blocks, dim=-1, sorted=False).indices
    blocks, _ = torch.sort(top, dim=-1)
    offsets = torch.arange(block_size, device=block_score.device)
    indices = (blocks[..., None] * block_size + offsets).flatten(2)
    in_range = indices < n
    indices = torch.where(in_range, indices, torch.zeros_like(indices))
    valid = in_range & torch.gather(candidates[:, None, :].expand(batch, kv_heads, n), 2, indices)
    return pad_selection(indices, valid, budget)


def page_bounds(keys: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise minimum and maximum key of each page of `page_size` consecutive positions (Quest, §3.2).

    Args:
        keys: `(B, H_kv, n, D)`; the last page may be partial.

    Returns:
        `(page_min, page_max)`, each `(B, H_kv, ceil(n / page_size), D)` in `keys.dtype`.
    """
    batch, kv_heads, n, dim = keys.shape
    n_pages = -(-n // page_size)
    pad = n_pages * page_size - n
    if pad:  # repeat the last key: it changes neither bound
        keys = torch.cat([keys, keys[:, :, -1:].expand(batch, kv_heads, pad, dim)], dim=2)
    paged = keys.view(batch, kv_heads, n_pages, page_size, dim)
    return paged.amin(dim=3), paged.amax(dim=3)


def select_pages(
    query: torch.Tensor,
    page_min: torch.Tensor,
    page_max: torch.Tensor,
    candidates: torch.Tensor,
    budget: int,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quest-style page selection (Tang et al., 2024, "Quest", §3.2): rank pages by an upper bound of q·k.

    The bound of a page is `Σ_d max(q_d · min_d, q_d · max_d)`, summed over the query heads of each GQA group;
    the top `budget // page_size` pages among those holding a candidate are returned as token positions.

    Args:
        query: `(B, H_q, D)`; page_min, page_max: `(B, H_kv, P, D)` from `page_bounds` over positions `[0, n)`.
        candidates: `(B, n)` bool selectable positions; budget: tokens per KV head (multiple of page_size).

    Returns:
        `(indices, valid)`, both `(B, H_kv, budget)`: int64 positions sorted ascending and bool validity
        (positions past `n` or outside the candidates are invalid).
    """
    batch, q_heads, dim = query.shape
    kv_heads, n_pages = page_min.shape[1], page_min.shape[2]
    n = candidates.shape[1]
    grouped = query.reshape(batch, kv_heads, q_heads // kv_heads, 1, dim).float()
    bound = torch.maximum(grouped * page_min[:, :, None].float(), grouped * page_max[:, :, None].float())
    score = bound.sum(-1).sum(2)  # (B, H_kv, P)
    padded = torch.nn.functional.pad(candidates, (0, n_pages * page_size - n))
    has_candidate = padded.view(batch, n_pages, page_size).any(-1)
    score = score.masked_fill(~has_candidate[:, None, :], float("-inf"))
    return _top_blocks(score, candidates, budget, page_size)
